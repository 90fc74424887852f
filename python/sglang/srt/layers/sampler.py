"""Turn next-token logits into token ids (greedy, temperature, top-k, top-p, min-p) and logprobs.

Pipeline per row (all rows vectorized; only seeded-noise generation loops over seeded rows):

1. penalties (:meth:`SamplingBatchInfo.apply_penalties`, in place), then the grammar bitmask
   (constrained decoding: disallowed tokens get ``-inf``; only when ``info.vocab_mask`` is set);
2. greedy rows (top_k == 1) take ``argmax`` (exact ties: lowest id, as ``torch.argmax``);
3. other rows: ``softmax(logits / temperature)``, then
   top-k (keep the k most likely), renormalize, top-p (nucleus sampling, Holtzman et al. 2020,
   "The Curious Case of Neural Text Degeneration", sec. 3.1: keep the smallest prefix of the sorted
   distribution whose mass is >= top_p, always keeping the top token; as in HF transformers and vLLM
   top-p acts on the top-k-renormalized distribution), min-p (Nguyen et al. 2024, "Turning Up the
   Heat: Min-p Sampling", sec. 3: drop tokens with p < min_p * p_max), renormalize, sample.
4. Unseeded rows draw with ``torch.multinomial`` and the Sampler's generator. Seeded rows use the
   exponential race (``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` samples ``i`` with probability
   ``p_i``; a Gumbel-max variant, Gumbel 1954 / Maddison et al. 2014) with noise from a generator
   seeded by ``mix(seed, tokens generated so far)``, so a seeded request samples the same tokens
   whatever else is in the batch.

Logprobs are ``log_softmax`` of the logits after penalties and the grammar mask but before temperature, top-k, top-p and
min-p (the model's own distribution, penalized), as SGLang reports by default. Tokens the grammar
masks out (logprob ``-inf``) are left out of the top-logprob lists (which may then be shorter than
asked), so every reported value is finite JSON; a requested ``token_ids_logprob`` id that is masked
reports ``None``.

Custom logit processors (client code, only with ``--enable-custom-logit-processor``) run after the
penalties and logit_bias and before the grammar mask; a processor that fails marks its rows in
``SamplerOutput.row_errors`` (the scheduler aborts those requests with a 400) instead of failing the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch

from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def seeded_step_seed(seed: int, step: int) -> int:
    """Deterministic 63-bit seed for (request seed, tokens generated so far).

    SplitMix64 finalizer (Steele et al. 2014, "Fast splittable pseudorandom number generators")
    over ``seed * golden_ratio + step``; stable across processes and Python versions (unlike ``hash``).
    """
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + (step & _MASK64) + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & ((1 << 63) - 1)


@dataclass
class SamplerOutput:
    """Result of :meth:`Sampler.forward`.

    Attributes:
        next_token_ids: [bs] int64 on the logits' device.
        logprobs: [bs] float32, log-probability of each chosen token (post-penalty, pre-temperature), or
            None when logprobs were not requested.
        top_logprobs: per row, the ``top_logprobs_nums[i]`` most likely ``(logprob, token_id)`` pairs
            (descending; empty list where the row asked for 0), or None when logprobs were not requested.
            Grammar-masked tokens (-inf) are left out.
        token_ids_logprobs: per row, ``(logprob or None if masked, token_id)`` for the row's requested
            ids (``SamplingBatchInfo.token_ids_logprobs``), None for rows without; None when no row asked.
        row_errors: rows whose custom logit processor failed -> the error message (None: no failure).
    """

    next_token_ids: torch.Tensor
    logprobs: Optional[torch.Tensor] = None
    top_logprobs: Optional[list[list[tuple[float, int]]]] = None
    token_ids_logprobs: Optional[list[Optional[list[tuple[Optional[float], int]]]]] = None
    row_errors: Optional[dict[int, str]] = None


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Apply top-k, top-p and min-p to probability rows and renormalize.

    Args:
        probs: [bs, vocab] float32 rows summing to 1 (temperature already applied).
        info: the batch; uses top_ks [bs] int64, top_ps [bs] f32, min_ps [bs] f32 and the need_* flags.
    Returns:
        [bs, vocab] float32 rows summing to 1, zero where a filter removed the token.
    """
    if info.need_top_k or info.need_top_p:
        sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
        vocab = probs.shape[-1]
        if info.need_top_k:
            ranks = torch.arange(vocab, device=probs.device).view(1, -1)
            sorted_p = sorted_p.masked_fill(ranks >= info.top_ks.view(-1, 1), 0.0)
            sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
        if info.need_top_p:
            mass_before = sorted_p.cumsum(dim=-1) - sorted_p
            top_ps = info.top_ps.view(-1, 1)
            drop = (mass_before >= top_ps) & (top_ps < 1.0)
            drop[:, 0] = False  # always keep the most likely token
            sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_p)
    if info.need_min_p:
        p_max = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < info.min_ps.view(-1, 1) * p_max, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


class Sampler:
    """Samples next tokens for a batch; see the module docstring for the exact pipeline.

    Args:
        random_seed: seeds the generator of unseeded rows (the server's ``--random-seed``).
        device: device of that generator; a generator for another device is made on first use with
            the same seed.
    """

    def __init__(self, random_seed: int = 0, device: Union[str, torch.device] = "cpu") -> None:
        self.random_seed = random_seed
        self._generators: dict[str, torch.Generator] = {}
        self._generator(torch.device(device))

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.random_seed)
            self._generators[key] = gen
        return gen

    def forward(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: Optional[list[int]] = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [bs, vocab] float32 on any device; penalties and the grammar mask are applied to it
                in place.
            info: the batch's sampling tensors (same device as ``logits``).
            return_logprob: also return the chosen tokens' logprobs and the top logprobs.
            top_logprobs_nums: per row, how many top logprobs to return (None = 0 for all).
        Returns:
            :class:`SamplerOutput`.
        Raises:
            ValueError: logits are not 2-D float32 of the batch's shape, or top_logprobs_nums has the wrong length.
        """
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(
                f"logits must be a [bs, vocab] float32 tensor, got {tuple(logits.shape)} {logits.dtype}; "
                "cast with logits.float()"
            )
        bs = logits.shape[0]
        if top_logprobs_nums is not None and len(top_logprobs_nums) != bs:
            raise ValueError(f"top_logprobs_nums must have {bs} entries, got {len(top_logprobs_nums)}")
        info.apply_penalties(logits)
        row_errors = None
        if info.custom_logit_processors is not None:
            row_errors = self._custom_processors().apply(logits, info.custom_logit_processors,
                                                         info.custom_params) or None
        if info.vocab_mask is not None:
            from sglang.srt.constrained.bitmask import apply_token_bitmask_, revive_dead_rows_

            apply_token_bitmask_(logits, info.vocab_mask)
            revive_dead_rows_(logits, info.vocab_mask)

        if info.is_all_greedy:
            next_ids = torch.argmax(logits, dim=-1)
        else:
            next_ids = self._sample(logits, info)

        if not return_logprob:
            return SamplerOutput(next_token_ids=next_ids, row_errors=row_errors)
        logprobs_all = torch.log_softmax(logits, dim=-1)
        chosen = logprobs_all.gather(-1, next_ids.view(-1, 1)).view(-1)
        return SamplerOutput(
            next_token_ids=next_ids,
            logprobs=chosen,
            top_logprobs=_top_logprobs(logprobs_all, top_logprobs_nums or [0] * bs),
            token_ids_logprobs=_token_ids_logprobs(logprobs_all, info.token_ids_logprobs),
            row_errors=row_errors,
        )

    def _custom_processors(self):
        """The :class:`~sglang.srt.sampling.custom_logit_processor.ProcessorCache` (made on first use)."""
        if getattr(self, "_processor_cache", None) is None:
            from sglang.srt.sampling.custom_logit_processor import ProcessorCache

            self._processor_cache = ProcessorCache()
        return self._processor_cache

    __call__ = forward

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        probs = filter_probs(probs, info)
        seeded_rows = [i for i, s in enumerate(info.seeds) if s is not None]
        next_ids = torch.multinomial(probs, 1, generator=self._generator(probs.device)).view(-1)
        if seeded_rows:
            noise = torch.empty(len(seeded_rows), probs.shape[-1], dtype=torch.float32, device=probs.device)
            for j, i in enumerate(seeded_rows):
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(seeded_step_seed(info.seeds[i], info.num_generated[i]))
                noise[j].exponential_(1.0, generator=gen)
            rows = torch.tensor(seeded_rows, device=probs.device)
            race = probs[rows] / noise.clamp_min_(torch.finfo(torch.float32).tiny)
            next_ids[rows] = torch.argmax(race, dim=-1)
        greedy_ids = torch.argmax(logits, dim=-1)
        return torch.where(info.greedy_mask, greedy_ids, next_ids)


def _top_logprobs(logprobs_all: torch.Tensor, nums: list[int]) -> list[list[tuple[float, int]]]:
    """Per row, the nums[i] largest (logprob, token_id) pairs, descending."""
    k = min(max(nums), logprobs_all.shape[-1]) if nums else 0
    if k <= 0:
        return [[] for _ in nums]
    values, ids = logprobs_all.topk(k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [[(v, t) for v, t in zip(values[i][: nums[i]], ids[i][: nums[i]]) if v != float("-inf")]
            for i in range(len(nums))]


def _token_ids_logprobs(logprobs_all: torch.Tensor,
                        wanted: Optional[list[Optional[list[int]]]]) -> Optional[list]:
    """Per row, ``(logprob, id)`` for the row's requested ids (None where the grammar masked the id)."""
    if wanted is None:
        return None
    out: list = []
    for i, ids in enumerate(wanted):
        if not ids:
            out.append(None)
            continue
        vals = logprobs_all[i, torch.tensor(ids, device=logprobs_all.device)].tolist()
        out.append([(v if v != float("-inf") else None, t) for v, t in zip(vals, ids)])
    return out
