"""Splitting a :class:`~sglang.srt.forward_batch_info.ForwardBatch` into sub-batches that run the decoder
layers separately and can be in flight together.

Both kinds of split are token ranges of the parent's flat new tokens:

* a **token split** (TokenWeave, Gond et al. 2025, sec. 3.1) cuts at any token; a request that
  straddles the cut contributes tokens ``[s, b)`` to the first part and ``[b, s + e)`` to the second,
  where the second part is an extend whose prefix is the request's cached prefix plus the first part
  (its KV is written by the first part's attention of the same layer, before the second part reads it);
* a **request split** (MegaScale-Infer, Zhu et al. 2025, sec. 4.1) cuts only between requests, into
  ``m`` micro-batches.

A sub-batch shares the parent's pools, backend, ``req_to_token`` rows and KV slots
(``out_cache_loc`` is a slice), gets its own request metadata and no attention metadata yet (the
executor builds it), records its ``token_range`` in the parent, and keeps the attributes the runner set on
the parent for the whole step outside the dataclass fields (e.g. the MoE all-to-all mode the DP ranks agreed on).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING

import torch

from sglang.srt.utils.tensor_transfer import ints_to_device

if TYPE_CHECKING:
    from sglang.srt.forward_batch_info import ForwardBatch


def _carry_step_attrs(parent: "ForwardBatch", child: "ForwardBatch") -> "ForwardBatch":
    """Give ``child`` the attributes set on ``parent`` outside its dataclass fields (``dataclasses.replace`` drops
    them): what the runner attached for the whole step, e.g. the MoE all-to-all mode every DP rank agreed on, which
    each sub-batch must use too. Returns ``child``."""
    names = {f.name for f in fields(parent)}
    for k, v in vars(parent).items():
        if k not in names:
            setattr(child, k, v)
    return child


def _req_pool_indices_cpu(fb: "ForwardBatch") -> list[int]:
    if len(fb.req_pool_indices_cpu) == fb.batch_size:
        return list(fb.req_pool_indices_cpu)
    return [int(v) for v in fb.req_pool_indices.tolist()]


def token_subbatch(fb: "ForwardBatch", lo: int, hi: int) -> "ForwardBatch":
    """The sub-batch of ``fb`` made of its flat new tokens ``[lo, hi)`` (``0 <= lo < hi <= N``).

    Every request with tokens in the range contributes them; a request cut at ``lo`` starts its part
    as an extend after ``prefix_len + (lo - start)`` tokens.
    Raises:
        ValueError: an empty or out-of-range token range.
    """
    n = fb.num_tokens
    if not 0 <= lo < hi <= n:
        raise ValueError(f"token range [{lo}, {hi}) is empty or outside [0, {n}]")
    rows = _req_pool_indices_cpu(fb)
    r_rows, r_prefix, r_ext = [], [], []
    start = 0
    for i, ext in enumerate(fb.extend_lens_cpu):
        a, b = max(lo, start), min(hi, start + ext)
        if a < b:
            r_rows.append(rows[i])
            r_prefix.append(fb.prefix_lens_cpu[i] + (a - start))
            r_ext.append(b - a)
        start += ext
    r_seq = [p + e for p, e in zip(r_prefix, r_ext)]
    starts = [0] * len(r_ext)
    for i in range(1, len(r_ext)):
        starts[i] = starts[i - 1] + r_ext[i - 1]
    parts = (r_rows, r_seq, r_prefix, r_ext, starts)
    flat = ints_to_device([v for p in parts for v in p], fb.input_ids.device)
    req_pool_indices, seq_lens, prefix_lens, extend_lens, extend_start_loc = torch.split(
        flat, [len(p) for p in parts])
    base = fb.token_range[0] if fb.token_range is not None else 0
    bs = len(r_rows)
    return _carry_step_attrs(fb, replace(
        fb, batch_size=bs, input_ids=fb.input_ids[lo:hi], positions=fb.positions[lo:hi],
        out_cache_loc=fb.out_cache_loc[lo:hi], req_pool_indices=req_pool_indices, seq_lens=seq_lens,
        prefix_lens=prefix_lens, extend_lens=extend_lens, extend_start_loc=extend_start_loc,
        seq_lens_cpu=r_seq, prefix_lens_cpu=r_prefix, extend_lens_cpu=r_ext, req_pool_indices_cpu=r_rows,
        return_logprob=False, input_logprob_indices=[[] for _ in range(bs)],
        input_logprob_token_ids=[[] for _ in range(bs)], top_logprobs_nums=[0] * bs, attn_metadata=None,
        token_range=(base + lo, base + hi)))


def split_decode_requests(fb: "ForwardBatch", num_micro_batches: int) -> list["ForwardBatch"]:
    """A DECODE batch cut into ``num_micro_batches`` contiguous request groups like :func:`split_requests`, but
    every device tensor of a part is a view (slice) of ``fb``'s, so the split runs no host-to-device copy: safe
    inside a CUDA graph capture, where a copy of host values would freeze them into the graph (a replay with new
    inputs then reads the capture's sequence lengths). ``extend_start_loc`` of a part is ``arange`` on the device.
    A parent without host request rows (``req_pool_indices_cpu`` empty, as the graph runner's) gives parts without
    them (no device-to-host read).

    Raises:
        ValueError: not a decode batch, or ``num_micro_batches`` outside ``[1, batch_size]``.
    """
    if not fb.forward_mode.is_decode():
        raise ValueError(f"split_decode_requests needs a DECODE batch, got {fb.forward_mode}")
    cuts = request_boundaries(fb.extend_lens_cpu, num_micro_batches)  # one token per request: tokens = requests
    # the host copy of the rows only when the parent has one: reading the device rows back would synchronize, which a
    # CUDA-graph capture forbids (the graph runner's batches carry no host rows)
    rows = list(fb.req_pool_indices_cpu) if len(fb.req_pool_indices_cpu) == fb.batch_size else None
    base = fb.token_range[0] if fb.token_range is not None else 0
    parts = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        bs = hi - lo
        parts.append(_carry_step_attrs(fb, replace(
            fb, batch_size=bs, input_ids=fb.input_ids[lo:hi], positions=fb.positions[lo:hi],
            out_cache_loc=fb.out_cache_loc[lo:hi], req_pool_indices=fb.req_pool_indices[lo:hi],
            seq_lens=fb.seq_lens[lo:hi], prefix_lens=fb.prefix_lens[lo:hi], extend_lens=fb.extend_lens[lo:hi],
            extend_start_loc=fb.extend_start_loc[lo:hi] - fb.extend_start_loc[lo],
            seq_lens_cpu=fb.seq_lens_cpu[lo:hi], prefix_lens_cpu=fb.prefix_lens_cpu[lo:hi],
            extend_lens_cpu=fb.extend_lens_cpu[lo:hi], req_pool_indices_cpu=rows[lo:hi] if rows is not None else [],
            return_logprob=False,
            input_logprob_indices=[[] for _ in range(bs)], input_logprob_token_ids=[[] for _ in range(bs)],
            top_logprobs_nums=[0] * bs, attn_metadata=None, token_range=(base + lo, base + hi))))
    return parts


def split_tokens(fb: "ForwardBatch", boundary: int) -> tuple["ForwardBatch", "ForwardBatch"]:
    """``(tokens [0, boundary), tokens [boundary, N))`` of ``fb`` (see the module docstring).

    Raises:
        ValueError: ``boundary`` outside ``[1, N-1]`` (a split must leave tokens on both sides).
    """
    n = fb.num_tokens
    if not 1 <= boundary <= n - 1:
        raise ValueError(f"split_tokens: boundary={boundary} must be in [1, {n - 1}] for a batch of {n} tokens")
    return token_subbatch(fb, 0, boundary), token_subbatch(fb, boundary, n)


def request_boundaries(extend_lens: list[int], num_micro_batches: int) -> list[int]:
    """Token offsets ``[0, b1, ..., N]`` cutting ``len(extend_lens)`` requests into ``num_micro_batches``
    contiguous groups whose request counts differ by at most one (earlier groups take the extra).

    Raises:
        ValueError: ``num_micro_batches`` outside ``[1, len(extend_lens)]``.
    """
    bs = len(extend_lens)
    if not 1 <= num_micro_batches <= bs:
        raise ValueError(f"split_requests: num_micro_batches={num_micro_batches} must be in [1, {bs}] "
                         f"(the batch has {bs} requests)")
    q, r = divmod(bs, num_micro_batches)
    cuts, req, tok = [0], 0, 0
    for j in range(num_micro_batches):
        take = q + (1 if j < r else 0)
        tok += sum(extend_lens[req:req + take])
        req += take
        cuts.append(tok)
    return cuts


def split_requests(fb: "ForwardBatch", num_micro_batches: int) -> list["ForwardBatch"]:
    """``fb`` cut between requests into ``num_micro_batches`` micro-batches (see :func:`request_boundaries`).

    Raises:
        ValueError: ``num_micro_batches`` outside ``[1, batch_size]``.
    """
    cuts = request_boundaries(fb.extend_lens_cpu, num_micro_batches)
    return [token_subbatch(fb, a, b) for a, b in zip(cuts[:-1], cuts[1:])]
