"""The scheduler -> worker contract (``ModelWorkerBatch``) and its device form (``ForwardBatch``).

One contract, as vLLM v1 keeps it: the scheduler decides *which* tokens run
and *where* their KV goes; the runner only executes. A batch is a list of
requests, each contributing ``extend_len`` new tokens after ``prefix_len``
tokens whose KV is already in the pool. Decode requests are the case
``extend_len == 1``; a mixed batch has prefill chunks and decodes together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Optional

import torch

from sglang.srt.utils.tensor_transfer import host_to_device, ints_to_device

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo


class ForwardMode(IntEnum):
    """What a batch does: EXTEND (prefill/extend only), DECODE (one token each), MIXED (both), IDLE (DP attention: no
    tokens on this rank, only the collectives other ranks' tokens need; SGLang's ``ForwardMode.IDLE``)."""

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4

    def is_decode(self) -> bool:
        """True for DECODE."""
        return self == ForwardMode.DECODE

    def is_extend(self) -> bool:
        """True for EXTEND and MIXED (batches holding prefill/extend tokens)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)


@dataclass
class ModelWorkerBatch:
    """What the scheduler hands the model runner for one step (CPU data only).

    Per request i (length ``bs`` lists):
        req_pool_indices[i]: its row in ``req_to_token``.
        prefix_lens[i]: tokens whose KV is already in the pool.
        extend_lens[i]: new tokens this step (1 for decode).
        seq_lens[i] = prefix_lens[i] + extend_lens[i].
        input_logprob_indices[i]: indices (0 .. extend_lens[i]-1, relative to
            the request's new tokens) whose logits must be turned into input
            logprobs; the logit at relative index j predicts the token
            ``input_logprob_token_ids[i][k]`` (the prompt token after it).
            Empty lists when no input logprobs are wanted.
        top_logprobs_nums[i]: number of top logprobs per position (0: none).
        sample[i]: whether to sample a next token (False for a prefill chunk
            that is not the request's last).
    Flat over all new tokens (length ``sum(extend_lens)``):
        input_ids, positions, out_cache_loc (the KV slot each new token writes).
    ``sampling_info`` is built by the scheduler (CPU); the runner moves it to
    the device.
    ``dp_step`` (DP attention): the step every DP rank agreed on (a
    :class:`~sglang.srt.dp_attention.step_sync.DpGlobalStep`: token counts per rank, the graph size all replay).
    ``future_token_ids`` (overlap scheduling on CUDA): ``[ring]`` int64 on the device; a negative input id
    ``-(slot+1)`` is a token still being sampled by an earlier batch, which the runner reads from
    ``future_token_ids[slot]`` on the device (``overlap_worker.resolve_future_ids``). None: every id is real.
    """

    forward_mode: ForwardMode
    input_ids: list[int]
    positions: list[int]
    out_cache_loc: torch.Tensor  # [num_tokens] int64 (pool device)
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]
    sample: list[bool]
    return_logprob: bool = False
    input_logprob_indices: list[list[int]] = field(default_factory=list)
    input_logprob_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs_nums: list[int] = field(default_factory=list)
    sampling_info: Optional["SamplingBatchInfo"] = None
    future_token_ids: Optional[torch.Tensor] = None  # overlap: device ring that resolves negative input ids
    dp_step: Any = None  # DP attention: the agreed DpGlobalStep
    gpu_timing: Optional[tuple] = None  # step trace: (start, end) CUDA events the runner records around forward

    @property
    def batch_size(self) -> int:
        """Number of requests in the batch."""
        return len(self.req_pool_indices)

    @property
    def num_tokens(self) -> int:
        """Number of new tokens over all requests (``sum(extend_lens)``)."""
        return len(self.input_ids)


@dataclass
class ForwardBatch:
    """Device tensors of one step, built by the runner from a :class:`ModelWorkerBatch`.

    Shapes: ``N`` = total new tokens, ``bs`` = requests.
        input_ids [N] int64, positions [N] int64, out_cache_loc [N] int64,
        req_pool_indices [bs] int64, seq_lens [bs] int64, extend_lens [bs]
        int64, prefix_lens [bs] int64, extend_start_loc [bs] int64 (offset of
        each request's first new token in the flat arrays). ``*_cpu`` lists
        mirror them for host-side loops. All tensors live on the model's device.

    Per-batch attention state: ``attn_metadata`` is whatever the batch's attention backend built for
    *this* batch in :meth:`AttentionBackend.init_forward_metadata` (None before that). It lives here,
    never on the backend, so several ForwardBatches (token splits, micro-batches) can be in flight on
    one backend at once.

    Splitting (the seam of TokenWeave and MegaScale-Infer): :meth:`split_tokens` cuts the flat tokens
    at any boundary (a request may straddle it: its second part is an extend over the first part's KV,
    which the first part writes in the same layer before the second part's attention reads it);
    :meth:`split_requests` cuts the requests into ``m`` micro-batches. Sub-batches share the parent's
    pools and backend, carry ``token_range`` (their ``[lo, hi)`` in the parent's flat tokens) and no
    logprob fields: the executor concatenates their hidden states and computes logits on the parent.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "MHATokenToKVPool"
    attn_backend: "AttentionBackend"
    return_logprob: bool = False
    input_logprob_indices: list[list[int]] = field(default_factory=list)
    input_logprob_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs_nums: list[int] = field(default_factory=list)
    req_pool_indices_cpu: list[int] = field(default_factory=list)
    attn_metadata: Any = None
    token_range: Optional[tuple[int, int]] = None
    token_ids_logprobs: Optional[list] = None  # per request, ids whose input logprobs are reported (or None)
    # [bs, vocab] float32 the logits processor writes ``next_token_logits`` into (the CUDA graphs' shared output
    # buffer), or None: a new tensor per forward
    logits_buffer: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        """Number of new tokens (``sum(extend_lens_cpu)``)."""
        return int(self.input_ids.shape[0])

    def split_tokens(self, boundary: int) -> tuple["ForwardBatch", "ForwardBatch"]:
        """Cut the flat tokens at ``boundary`` into a prefix split ``[0, boundary)`` and a suffix split
        ``[boundary, N)`` (TokenWeave, Gond et al. 2025, sec. 3.1: token-level splits; a request that
        straddles the boundary keeps its first part in the prefix split and continues as an extend in
        the suffix split). Run the prefix split's attention of a layer before the suffix split's.

        Raises:
            ValueError: ``boundary`` is not in ``[1, N-1]``.
        """
        from sglang.srt.batch_split import split_tokens

        return split_tokens(self, boundary)

    def split_requests(self, num_micro_batches: int) -> list["ForwardBatch"]:
        """Cut the requests into ``num_micro_batches`` contiguous micro-batches of near-equal request
        counts (MegaScale-Infer, Zhu et al. 2025, sec. 4.1: the ping-pong pipeline's m micro-batches).

        Raises:
            ValueError: ``num_micro_batches`` is not in ``[1, batch_size]``.
        """
        from sglang.srt.batch_split import split_requests

        return split_requests(self, num_micro_batches)

    @classmethod
    def init_new(cls, batch: ModelWorkerBatch, device: torch.device, req_to_token_pool, token_to_kv_pool,
                 attn_backend) -> "ForwardBatch":
        """Move a :class:`ModelWorkerBatch` to ``device``: its integer lists become int64 tensors on ``device``
        (one asynchronous pinned host-to-device copy on CUDA, see :mod:`sglang.srt.utils.tensor_transfer`)
        with the shapes of the class docstring, ``extend_start_loc`` computed from ``extend_lens``; the
        ``*_cpu`` lists are copies of the batch's lists. ``req_to_token_pool`` / ``token_to_kv_pool`` /
        ``attn_backend`` are shared, not copied; ``attn_metadata`` is None until the executor builds it.
        Empty logprob fields get per-request defaults. Raises nothing itself (a malformed batch fails in
        ``torch.split`` with a RuntimeError)."""

        starts = [0] * batch.batch_size
        for i in range(1, batch.batch_size):
            starts[i] = starts[i - 1] + batch.extend_lens[i - 1]
        # one host-to-device copy for all integer metadata, then views into it
        parts = (batch.input_ids, batch.positions, batch.req_pool_indices, batch.seq_lens, batch.prefix_lens,
                 batch.extend_lens, starts)
        flat = ints_to_device([v for p in parts for v in p], device)
        (input_ids, positions, req_pool_indices, seq_lens, prefix_lens, extend_lens,
         extend_start_loc) = torch.split(flat, [len(p) for p in parts])
        return cls(
            forward_mode=batch.forward_mode,
            batch_size=batch.batch_size,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=host_to_device(batch.out_cache_loc, device, torch.int64),
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            extend_start_loc=extend_start_loc,
            seq_lens_cpu=list(batch.seq_lens),
            prefix_lens_cpu=list(batch.prefix_lens),
            extend_lens_cpu=list(batch.extend_lens),
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            attn_backend=attn_backend,
            return_logprob=batch.return_logprob,
            input_logprob_indices=list(batch.input_logprob_indices) or [[] for _ in range(batch.batch_size)],
            input_logprob_token_ids=list(batch.input_logprob_token_ids) or [[] for _ in range(batch.batch_size)],
            top_logprobs_nums=list(batch.top_logprobs_nums) or [0] * batch.batch_size,
            req_pool_indices_cpu=list(batch.req_pool_indices),
            token_ids_logprobs=getattr(batch.sampling_info, "token_ids_logprobs", None),
        )
