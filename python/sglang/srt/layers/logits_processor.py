"""Final projection to vocabulary logits, and input-token logprobs.

Only the rows that are needed are projected: each request's last new token
(for sampling) and, when asked, the rows that yield input logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from sglang.srt.layers import ops


INPUT_LOGPROB_CHUNK_ROWS = 1024  # prompt positions whose full-vocabulary log-probs are materialised at once


@dataclass
class LogitsProcessorOutput:
    """Result of :class:`LogitsProcessor`.

    next_token_logits: [bs, vocab] float32, logits at each request's last new token.
    input_token_logprobs: per request, the log-probabilities (floats) of the
        requested prompt tokens (``ForwardBatch.input_logprob_token_ids``), or None.
    input_top_logprobs: per request, per requested row, ``top_logprobs_num``
        (logprob, token_id) pairs, or None.
    input_token_ids_logprobs: per request, per requested row, (logprob, token_id) pairs of the
        request's ``token_ids_logprob`` ids (empty lists for requests without), or None.
    """

    next_token_logits: torch.Tensor
    input_token_logprobs: Optional[list[list[float]]] = None
    input_top_logprobs: Optional[list[list[list[tuple[float, int]]]]] = None
    input_token_ids_logprobs: Optional[list[list[list[tuple[float, int]]]]] = None


class LogitsProcessor(nn.Module):
    """Projects hidden states to logits with the LM head weight ([vocab, hidden]).

    ``logit_scale`` multiplies the logits (1.0 for most models).
    Tensor parallelism: with ``tp_size > 1`` the weight is this rank's vocabulary shard
    ``[V_pad/tp, hidden]`` (:class:`~sglang.srt.layers.vocab_parallel_embedding.ParallelLMHead`);
    the local logits are all-gathered over ``comm`` (in the model dtype, then cast to fp32) and the
    padding columns dropped, so every rank holds the full ``[rows, vocab]`` logits.
    Raises ValueError (at forward) when ``tp_size > 1`` and ``comm`` is None.
    """

    def __init__(self, vocab_size: int, logit_scale: float = 1.0, tp_size: int = 1, comm=None):
        super().__init__()
        self.vocab_size = vocab_size
        self.logit_scale = logit_scale
        self.tp_size, self.comm = tp_size, comm
        # the DecodeGemmTable the CUDA-graph runner measured on this device (decode_gemm.install), or None
        self.decode_gemm = None

    def _project(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[rows, vocab]`` float32 logits of ``hidden`` ``[rows, hidden]``; written into ``out`` (``[rows, vocab]``
        float32, e.g. the CUDA graphs' shared buffer) when given, with the same one cast-copy as without it."""
        if self.decode_gemm is not None:
            logits = ops.linear(hidden, lm_head_weight, None, table=self.decode_gemm)
        else:
            logits = torch.matmul(hidden, lm_head_weight.t())
        if self.tp_size > 1:
            if self.comm is None:
                raise ValueError("LogitsProcessor with tp_size > 1 needs a comm object to all-gather the logits")
            logits = self.comm.all_gather(logits, dim=-1)
        if out is not None:
            if tuple(out.shape) != (logits.shape[0], self.vocab_size) or out.dtype != torch.float32:
                raise ValueError(f"logits buffer {tuple(out.shape)} {out.dtype}: want "
                                 f"({logits.shape[0]}, {self.vocab_size}) float32")
            out.copy_(logits[:, : self.vocab_size])
            return out.mul_(self.logit_scale) if self.logit_scale != 1.0 else out
        logits = logits.float()[:, : self.vocab_size]
        return logits * self.logit_scale if self.logit_scale != 1.0 else logits

    def forward(self, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, forward_batch) -> LogitsProcessorOutput:
        """hidden_states: [N, hidden] (final-normed) -> :class:`LogitsProcessorOutput`."""
        fb = forward_batch
        if fb.forward_mode.is_decode():
            last = hidden_states
        else:
            last_idx = fb.extend_start_loc + fb.extend_lens - 1
            last = hidden_states[last_idx]
        out = LogitsProcessorOutput(next_token_logits=self._project(last, lm_head_weight,
                                                                    getattr(fb, "logits_buffer", None)))
        if not fb.return_logprob or not any(fb.input_logprob_indices):
            return out
        rows, targets, counts = [], [], []
        starts = fb.extend_start_loc.tolist()
        for i, idx in enumerate(fb.input_logprob_indices):
            rows.extend(starts[i] + j for j in idx)
            targets.extend(fb.input_logprob_token_ids[i])
            counts.append(len(idx))
        dev = hidden_states.device
        k_max = max(fb.top_logprobs_nums) if fb.top_logprobs_nums else 0
        wanted = getattr(fb, "token_ids_logprobs", None)
        picked, top_v, top_i = [], ([] if k_max > 0 else None), ([] if k_max > 0 else None)
        ids_rows = []  # per chunk row: the log-probs of the requested ids (token_ids_logprobs), filled below
        row_req = [i for i, c in enumerate(counts) for _ in range(c)]
        # the [rows, vocab] float32 log-probs exist one chunk of INPUT_LOGPROB_CHUNK_ROWS rows at a time (an 8K-token
        # prompt would otherwise take 8192 x vocab x 10 bytes at once: 10.5 GB for Llama-3)
        for lo in range(0, len(rows), INPUT_LOGPROB_CHUNK_ROWS):
            hi = min(lo + INPUT_LOGPROB_CHUNK_ROWS, len(rows))
            lp = torch.log_softmax(self._project(hidden_states[torch.tensor(rows[lo:hi], device=dev)],
                                                 lm_head_weight), dim=-1)
            tgt = torch.tensor(targets[lo:hi], device=dev)
            picked.extend(lp.gather(1, tgt.unsqueeze(1)).squeeze(1).tolist())
            if k_max > 0:
                v, ix = lp.topk(k_max, dim=-1)
                top_v.extend(v.tolist())
                top_i.extend(ix.tolist())
            if wanted:  # per request's run of rows inside this chunk: one gather of its requested ids
                r = lo
                while r < hi:
                    req, e = row_req[r], r
                    while e < hi and row_req[e] == req:
                        e += 1
                    ids = wanted[req] if req < len(wanted) else None
                    ids_rows.extend(lp[r - lo:e - lo][:, torch.tensor(ids, device=dev)].tolist() if ids
                                    else [None] * (e - r))
                    r = e
        out.input_token_logprobs, out.input_top_logprobs = [], []
        pos = 0
        for i, c in enumerate(counts):
            out.input_token_logprobs.append(picked[pos:pos + c])
            k = fb.top_logprobs_nums[i]
            out.input_top_logprobs.append(
                [list(zip(top_v[r][:k], top_i[r][:k])) for r in range(pos, pos + c)] if k > 0 else []
            )
            pos += c
        if wanted:
            out.input_token_ids_logprobs, pos = [], 0
            for i, c in enumerate(counts):
                ids = wanted[i] if i < len(wanted) else None
                if ids and c:
                    out.input_token_ids_logprobs.append([list(zip(v, ids)) for v in ids_rows[pos:pos + c]])
                else:
                    out.input_token_ids_logprobs.append([])
                pos += c
        return out
