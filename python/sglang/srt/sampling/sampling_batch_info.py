"""Batched sampling parameters as device tensors, plus logit penalties.

One :class:`SamplingBatchInfo` is built per forward step from the requests in
the batch (:meth:`SamplingBatchInfo.from_reqs`) and consumed by
:class:`sglang.srt.layers.sampler.Sampler`.

Penalties (applied in this order by :meth:`SamplingBatchInfo.apply_penalties`):

* repetition penalty (Keskar et al. 2019, "CTRL", sec. 4.1; HF transformers semantics): for every
  token seen in the prompt or the output, a logit > 0 is divided by the penalty, otherwise multiplied;
* frequency / presence penalties (OpenAI API semantics, as in SGLang and vLLM):
  ``logit -= frequency_penalty * count(output) + presence_penalty * (count(output) > 0)``;
* min_new_tokens: the request's banned ids (its stop tokens and EOS) get ``-inf`` while it has
  generated fewer than ``min_new_tokens`` tokens (ids outside the vocabulary are dropped);
* logit_bias (OpenAI semantics): ``logit[token] += bias`` for the request's ``{token id: bias}`` map.

Custom logit processors (``--enable-custom-logit-processor``) run after these, in the sampler.

Constrained decoding: when some request has a grammar, ``vocab_mask`` holds the packed bitmask of
allowed next tokens (filled from each grammar matcher, all bits set for rows without a grammar);
the sampler applies it after the penalties (:mod:`sglang.srt.constrained.bitmask`). Batches without
grammars carry ``vocab_mask=None`` and pay nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from sglang.srt.utils.tensor_transfer import columns_to_device, host_to_device

from sglang.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def build_vocab_mask(grammars: Optional[Sequence[Any]], vocab_size: int,
                     device: torch.device) -> Optional[torch.Tensor]:
    """The packed [bs, ceil(vocab_size / 32)] int32 bitmask of the rows' grammars on ``device``, or None.

    Rows whose grammar is None allow every token (all bits set); None when no row has a grammar.
    """
    if grammars is None or all(g is None for g in grammars):
        return None
    from sglang.srt.constrained.bitmask import allocate_token_bitmask

    mask = allocate_token_bitmask(len(grammars), vocab_size)
    for i, g in enumerate(grammars):
        if g is not None:
            g.fill_vocab_mask(mask, i)
    return host_to_device(mask, device)


@dataclass
class SamplingBatchInfo:
    """Sampling tensors of one batch (``bs`` rows) on ``device``.

    Attributes:
        temperatures: [bs, 1] float32 (1.0 for greedy rows).
        top_ps: [bs] float32. top_ks: [bs] int64, ``vocab_size`` where top-k is off.
        min_ps: [bs] float32.
        greedy_mask: [bs] bool, rows that take the argmax (top_k == 1).
        is_all_greedy: every row is greedy. need_top_p / need_top_k / need_min_p: some
            non-greedy row uses that filter.
        frequency_penalties / presence_penalties / repetition_penalties: [bs] float32, or None
            when no row uses that penalty.
        seeds: per-row seed (None = unseeded, sampled from the Sampler's generator).
        num_generated: per-row count of tokens generated so far (derives the seeded noise stream).
        min_tokens_banned: per-row list of ids banned while ``num_generated < min_new_tokens``.
        logit_bias: [bs, vocab] float32 additive biases, or None when no row has a ``logit_bias``.
        token_ids_logprobs: per row, the token ids whose logprobs are reported (None = none), or None.
        custom_logit_processors / custom_params: per row, a serialized custom processor (or None) and
            its ``custom_params``; None when no row has a processor.
        vocab_mask: [bs, ceil(vocab_size / 32)] int32 on ``device``, the grammar bitmask of allowed
            next tokens (bit j of word i = token 32 i + j; rows without a grammar all -1), or None
            when no request has a grammar. It reflects the grammar state at build time and is not
            advanced by :meth:`cumulate_output_tokens`.
    """

    vocab_size: int
    device: torch.device
    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    greedy_mask: torch.Tensor
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    seeds: list[Optional[int]]
    num_generated: list[int]
    min_new_tokens: list[int]
    min_tokens_banned: list[list[int]]
    frequency_penalties: Optional[torch.Tensor] = None
    presence_penalties: Optional[torch.Tensor] = None
    repetition_penalties: Optional[torch.Tensor] = None
    vocab_mask: Optional[torch.Tensor] = None
    logit_bias: Optional[torch.Tensor] = None
    token_ids_logprobs: Optional[list[Optional[list[int]]]] = None
    custom_logit_processors: Optional[list[Optional[str]]] = None
    custom_params: Optional[list[Optional[dict]]] = None
    _output_ids: list[Sequence[int]] = field(default_factory=list, repr=False)
    _input_ids: Optional[list[Sequence[int]]] = field(default=None, repr=False)
    _output_counts: Optional[torch.Tensor] = field(default=None, repr=False)
    _seen_mask: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        """Number of rows (requests)."""
        return len(self.seeds)

    @property
    def has_seeded_rows(self) -> bool:
        """True if any row has a per-request seed."""
        return any(s is not None for s in self.seeds)

    @property
    def need_penalties(self) -> bool:
        """True if any row uses a frequency, presence or repetition penalty or is still under ``min_new_tokens``."""
        return (
            self.frequency_penalties is not None
            or self.presence_penalties is not None
            or self.repetition_penalties is not None
            or self._min_tokens_rows() != []
            or self.logit_bias is not None
        )

    @classmethod
    def from_reqs(
        cls,
        params: list[SamplingParams],
        device: Union[str, torch.device],
        vocab_size: int,
        output_ids: list[Sequence[int]],
        input_ids: Optional[list[Sequence[int]]] = None,
        min_tokens_banned: Optional[list[list[int]]] = None,
        grammars: Optional[Sequence[Any]] = None,
        token_ids_logprobs: Optional[list[Optional[list[int]]]] = None,
        custom_logit_processors: Optional[list[Optional[str]]] = None,
    ) -> "SamplingBatchInfo":
        """Build the batch tensors.

        Args:
            params: normalized :class:`SamplingParams` per request (greedy folded into top_k=1).
            device: where the tensors live (the logits' device).
            vocab_size: logits width; top_k = -1 or > vocab_size becomes vocab_size.
            output_ids: tokens each request generated so far (its length is the seeded-noise step and
                the min_new_tokens progress; its contents feed frequency/presence/repetition penalties).
            input_ids: prompt ids per request; required only if some request has repetition_penalty != 1.
            min_tokens_banned: per request, the ids to ban while ``len(output_ids) < min_new_tokens``
                (the scheduler passes stop_token_ids plus EOS ids unless ignore_eos). Default:
                ``params.stop_token_ids``.
            grammars: per request, its grammar object (:class:`~sglang.srt.constrained.base_grammar_backend.
                BaseGrammarObject`) or None; builds ``vocab_mask`` when any is set.
            token_ids_logprobs: per request, ids whose logprobs to report at each sampled position.
            custom_logit_processors: per request, a serialized custom logit processor or None.
        Raises:
            ValueError: list lengths differ, or input_ids is missing while a repetition penalty is set.
        """
        bs = len(params)
        if len(output_ids) != bs or (input_ids is not None and len(input_ids) != bs):
            raise ValueError(
                f"params ({bs}), output_ids ({len(output_ids)}) and input_ids "
                f"({None if input_ids is None else len(input_ids)}) must have one entry per request"
            )
        if min_tokens_banned is not None and len(min_tokens_banned) != bs:
            raise ValueError(f"min_tokens_banned must have {bs} entries, got {len(min_tokens_banned)}")
        if grammars is not None and len(grammars) != bs:
            raise ValueError(f"grammars must have {bs} entries, got {len(grammars)}")
        device = torch.device(device)
        top_ks_list = [vocab_size if (p.top_k < 0 or p.top_k > vocab_size) else p.top_k for p in params]
        greedy = [k == 1 for k in top_ks_list]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]

        def col(values, dtype):
            """``values`` as a ``[bs]`` tensor of ``dtype`` on ``device`` (non-blocking copy)."""
            return host_to_device(torch.tensor(values, dtype=dtype), device)

        sampled = [i for i in range(bs) if not greedy[i]]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        rep = [p.repetition_penalty for p in params]
        use_rep = any(r != 1.0 for r in rep)
        if use_rep and input_ids is None:
            raise ValueError("input_ids is required when a request sets repetition_penalty != 1")
        if min_tokens_banned is None:
            min_tokens_banned = [list(p.stop_token_ids or []) for p in params]
        # stop_token_ids outside the vocabulary are accepted (they never match) but cannot be indexed
        min_tokens_banned = [[t for t in b if 0 <= t < vocab_size] for b in min_tokens_banned]
        bias = None
        if any(getattr(p, "logit_bias", None) for p in params):
            rows, cols, vals = [], [], []
            for i, p in enumerate(params):
                for k, v in (getattr(p, "logit_bias", None) or {}).items():
                    if 0 <= int(k) < vocab_size:
                        rows.append(i)
                        cols.append(int(k))
                        vals.append(float(v))
            bias_cpu = torch.zeros(bs, vocab_size, dtype=torch.float32)
            bias_cpu[torch.tensor(rows, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64)] = torch.tensor(vals)
            bias = host_to_device(bias_cpu, device)
        has_custom = custom_logit_processors is not None and any(c is not None for c in custom_logit_processors)
        # the five columns every batch has: one host-to-device copy (typed views of one device buffer)
        temps_t, top_ps_t, top_ks_t, min_ps_t, greedy_t = columns_to_device(
            [(temps, torch.float32), (top_ps, torch.float32), (top_ks_list, torch.int64), (min_ps, torch.float32),
             (greedy, torch.bool)], device)
        return cls(
            vocab_size=vocab_size,
            device=device,
            temperatures=temps_t.view(bs, 1),
            top_ps=top_ps_t,
            top_ks=top_ks_t,
            min_ps=min_ps_t,
            greedy_mask=greedy_t,
            is_all_greedy=all(greedy),
            need_top_p=any(top_ps[i] < 1.0 for i in sampled),
            need_top_k=any(top_ks_list[i] < vocab_size for i in sampled),
            need_min_p=any(min_ps[i] > 0.0 for i in sampled),
            seeds=[p.seed for p in params],
            num_generated=[len(o) for o in output_ids],
            min_new_tokens=[p.min_new_tokens for p in params],
            min_tokens_banned=[list(b) for b in min_tokens_banned],
            frequency_penalties=col(freq, torch.float32) if any(f != 0.0 for f in freq) else None,
            presence_penalties=col(pres, torch.float32) if any(f != 0.0 for f in pres) else None,
            repetition_penalties=col(rep, torch.float32) if use_rep else None,
            vocab_mask=build_vocab_mask(grammars, vocab_size, device),
            logit_bias=bias,
            token_ids_logprobs=(list(token_ids_logprobs) if token_ids_logprobs is not None
                                and any(t for t in token_ids_logprobs) else None),
            custom_logit_processors=list(custom_logit_processors) if has_custom else None,
            custom_params=[getattr(p, "custom_params", None) for p in params] if has_custom else None,
            _output_ids=list(output_ids),
            _input_ids=list(input_ids) if input_ids is not None else None,
        )

    # --------------------------------------------------------------- counts
    def _scatter_rows(self, rows: list[Sequence[int]], accumulate: bool) -> torch.Tensor:
        """[bs, vocab] float32: per row, counts (accumulate) or 1.0 marks of the given ids."""
        out = torch.zeros(self.batch_size, self.vocab_size, dtype=torch.float32)
        row_idx = [i for i, r in enumerate(rows) for _ in r]
        tok_idx = [t for r in rows for t in r]
        if tok_idx:
            r = torch.tensor(row_idx, dtype=torch.int64)
            t = torch.tensor(tok_idx, dtype=torch.int64)
            if accumulate:
                out.index_put_((r, t), torch.ones(len(tok_idx)), accumulate=True)
            else:
                out[r, t] = 1.0
        return host_to_device(out, self.device)

    @property
    def output_counts(self) -> torch.Tensor:
        """[bs, vocab] float32 counts of each row's output tokens (built on first use)."""
        if self._output_counts is None:
            self._output_counts = self._scatter_rows(self._output_ids, accumulate=True)
        return self._output_counts

    @property
    def seen_mask(self) -> torch.Tensor:
        """[bs, vocab] bool: token appears in the row's prompt or output (built on first use)."""
        if self._seen_mask is None:
            assert self._input_ids is not None
            rows = [list(a) + list(b) for a, b in zip(self._input_ids, self._output_ids)]
            self._seen_mask = self._scatter_rows(rows, accumulate=False) > 0
        return self._seen_mask

    def cumulate_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Account one new token per row (when the same info is reused for the next decode step).

        Args:
            next_token_ids: [bs] int64 on ``device``, the tokens just sampled.
        """
        rows = torch.arange(self.batch_size, device=next_token_ids.device)
        if self._output_counts is not None:
            self._output_counts[rows, next_token_ids] += 1.0
        if self._seen_mask is not None:
            self._seen_mask[rows, next_token_ids] = True
        ids = next_token_ids.tolist()
        self._output_ids = [list(o) + [t] for o, t in zip(self._output_ids, ids)]
        self.num_generated = [n + 1 for n in self.num_generated]

    def _min_tokens_rows(self) -> list[int]:
        return [
            i for i in range(self.batch_size)
            if self.num_generated[i] < self.min_new_tokens[i] and self.min_tokens_banned[i]
        ]

    # ------------------------------------------------------------ penalties
    def apply_penalties(self, logits: torch.Tensor) -> None:
        """Apply repetition, frequency, presence and min_new_tokens penalties and logit_bias in place.

        Args:
            logits: [bs, vocab_size] float32 on ``device``; modified in place.
        Raises:
            ValueError: the logits shape does not match the batch.
        """
        if logits.shape != (self.batch_size, self.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match the batch "
                f"({self.batch_size}, {self.vocab_size})"
            )
        if self.repetition_penalties is not None:
            pen = self.repetition_penalties.view(-1, 1)
            penalized = torch.where(logits > 0, logits / pen, logits * pen)
            logits.copy_(torch.where(self.seen_mask, penalized, logits))
        if self.frequency_penalties is not None:
            logits.sub_(self.frequency_penalties.view(-1, 1) * self.output_counts)
        if self.presence_penalties is not None:
            logits.sub_(self.presence_penalties.view(-1, 1) * (self.output_counts > 0).float())
        rows = self._min_tokens_rows()
        if rows:
            r = [i for i in rows for _ in self.min_tokens_banned[i]]
            t = [tid for i in rows for tid in self.min_tokens_banned[i]]
            logits[torch.tensor(r, device=logits.device), torch.tensor(t, device=logits.device)] = float("-inf")
        if self.logit_bias is not None:
            logits.add_(self.logit_bias)
