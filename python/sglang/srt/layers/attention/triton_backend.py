"""Triton attention backend over the paged KV pool (GPU default).

Decode batches run the split-KV flash-decoding kernel
(:mod:`.triton_ops.decode_attention`); extend batches run the prefix-aware
FlashAttention-2 style kernel (:mod:`.triton_ops.extend_attention`); a mixed
batch sends its one-token rows to the decode kernel and the rest to the extend
kernel. Both read K/V through
``req_to_token`` directly, so no per-batch KV index list is built.

Per-batch state: the metadata is stored on the ForwardBatch (``forward_batch.attn_metadata``), never on
the backend, so several batches (token splits, micro-batches) can be live on one backend. The decode
split workspace is shared: kernels that use it must run in stream order (one compute stream), which
every executor guarantees for attention.

CUDA graphs: the decode path does no host synchronisation. The number of KV
splits depends only on the batch size and the KV head count, and the split
workspace can be preallocated with :meth:`TritonAttnBackend.init_cuda_graph_state`;
the metadata keeps references to the ForwardBatch's device tensors, so a graph
captured with a ForwardBatch built on static buffers replays with whatever
those buffers hold. The ``balanced`` split policy's row order is a device op of
:meth:`TritonAttnBackend.init_forward_metadata`, so a graph must capture that call
(the CUDA-graph runner does) for the order to follow the replayed lengths.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.layers import ops
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.extend_dense import EXTEND_IMPLS, extend_impl_from_env, prefix_free_attention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.layers.attention.triton_ops.decode_attention import (BALANCED_MIN_SPLIT_LEN, SPLIT_POLICIES,
                                                                      decode_attention_fwd, decode_row_order,
                                                                      default_num_kv_splits)
from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd
from sglang.srt.forward_batch_info import ForwardMode
from sglang.srt.utils.tensor_transfer import ints_to_device

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

MAX_KV_SPLITS = 16
LEGACY_DECODE_ENV = "SGLANG_TRITON_DECODE_LEGACY"
SPLIT_POLICY_ENV = "SGLANG_DECODE_SPLIT_POLICY"
DEFAULT_SPLIT_POLICY = "balanced"
FUSED_ROPE_ENV = "SGLANG_FUSED_ROPE_KV"


def _plain_rope(rotary) -> bool:
    """True when ``rotary`` is a :class:`RotaryEmbedding` whose rotation is exactly its ``cos_sin_cache`` (no subclass
    overriding ``forward``), i.e. what the fused RoPE + KV-store kernel computes."""
    return isinstance(rotary, RotaryEmbedding) and type(rotary).forward is RotaryEmbedding.forward


@dataclass(frozen=True)
class TritonAttnMetadata:
    """Per-batch launch data computed once by :meth:`TritonAttnBackend.init_forward_metadata` and stored
    as ``forward_batch.attn_metadata``.

    ``is_decode``: every request adds exactly one token (decode kernel only).
    ``num_kv_splits``: splits per (request, KV head) of the decode kernel (from the decode row count only).
    ``decode_order``: ``[decode rows]`` int64 device tensor, the decode rows longest first (the ``balanced`` split
    policy's launch order, computed on the device by this call: inside a captured CUDA graph it is recomputed at
    every replay), or None (batch order). ``min_split_len``: the decode kernel's length-aware split rule (0: off).
    ``dense_segments``: ``(first token, length)`` of the prefix-free prefill rows that PyTorch's fused attention runs
    (``SGLANG_EXTEND_ATTENTION``, :mod:`.extend_dense`); those rows are not among the extend-kernel tensors.
    ``max_extend_len``: host int, largest extend length among the rows sent to the extend kernel.
    Extend-kernel tensors ([rows] integer, device): ``req_pool_indices``, ``prefix_lens``, ``extend_lens``,
    ``extend_start_loc`` (query row offsets into the batch's flat q). Decode-kernel tensors: ``decode_req_pool_indices``,
    ``decode_seq_lens`` and, for a mixed batch, ``decode_token_index`` (the flat q row of each decode request;
    None when the whole batch is decode, rows then being requests in order). Either group may be empty (None).
    """

    is_decode: bool
    num_kv_splits: int
    max_extend_len: int
    num_decode: int
    req_pool_indices: Optional[torch.Tensor]
    prefix_lens: Optional[torch.Tensor]
    extend_lens: Optional[torch.Tensor]
    extend_start_loc: Optional[torch.Tensor]
    decode_req_pool_indices: Optional[torch.Tensor]
    decode_seq_lens: Optional[torch.Tensor]
    decode_token_index: Optional[torch.Tensor]
    decode_order: Optional[torch.Tensor] = None
    min_split_len: int = 0
    dense_segments: tuple = ()


class TritonAttnBackend(AttentionBackend):
    """Triton paged attention (see :class:`AttentionBackend` for the contract).

    Supports any head_dim (fast tiles for 64/128/256; smaller or odd sizes are padded to a power of
    two >= 16 inside the kernels by masks) and any GQA ratio. Tensors must be on CUDA (or CPU under
    ``TRITON_INTERPRET=1`` for tests).
    """

    fuses_rope_kv_store = True  # RadixAttention hands RoPE to forward() (see its ``rope`` argument)

    def __init__(self, legacy_decode: Optional[bool] = None, fused_rope: Optional[bool] = None,
                 split_policy: Optional[str] = None, extend_impl: Optional[str] = None) -> None:
        """``legacy_decode``: run the decode kernel and split-count rule of the legacy decode path (see
        :func:`~sgl_kernel.triton.decode_attention.decode_attention_fwd`); None reads the environment variable
        ``SGLANG_TRITON_DECODE_LEGACY`` (``1`` = legacy). ``fused_rope``: RoPE fused with the KV-cache store (see
        :meth:`forward`); None reads ``SGLANG_FUSED_ROPE_KV`` (``0`` = separate RoPE kernel and indexed stores, as
        before). Both are read once, here, so benchmarks can compare old and new in one run. (The fused split
        reduce, ``SGLANG_DECODE_FUSED_REDUCE``, was removed: no measurable gain on an H100.)
        ``split_policy``: the decode split rule (:data:`SPLIT_POLICIES`): ``balanced`` (default; the ``wave`` split
        count, rows launched longest first, short rows on fewer splits), ``wave`` (the rule before: rows in batch
        order, every row on every split) or ``legacy``; None reads ``SGLANG_DECODE_SPLIT_POLICY``; ``legacy_decode``
        (or ``SGLANG_TRITON_DECODE_LEGACY=1``) forces ``legacy``.

        ``extend_impl``: who runs prefill rows without a cached prefix (:data:`EXTEND_IMPLS`, see
        :mod:`~sglang.srt.layers.attention.extend_dense`); None reads ``SGLANG_EXTEND_ATTENTION`` (default triton).

        Raises:
            ValueError: an unknown split policy or extend implementation (argument or environment), naming the
                choices."""
        if legacy_decode is None:
            legacy_decode = os.environ.get(LEGACY_DECODE_ENV, "0") not in ("", "0")
        self.legacy_decode = bool(legacy_decode)
        if fused_rope is None:
            fused_rope = os.environ.get(FUSED_ROPE_ENV, "1") not in ("", "0")
        self.fused_rope = bool(fused_rope)
        if split_policy is None:
            split_policy = os.environ.get(SPLIT_POLICY_ENV, "").strip() or DEFAULT_SPLIT_POLICY
        if split_policy not in SPLIT_POLICIES:
            raise ValueError(f"decode split policy {split_policy!r} ({SPLIT_POLICY_ENV}): use one of {SPLIT_POLICIES}")
        self.split_policy = "legacy" if self.legacy_decode else split_policy
        self.extend_impl = extend_impl_from_env() if extend_impl is None else extend_impl
        if self.extend_impl not in EXTEND_IMPLS:
            raise ValueError(f"extend_impl={self.extend_impl!r}: use one of {EXTEND_IMPLS}")
        self._workspace: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        # Buffers replaced by a larger one stay alive: a captured CUDA graph keeps writing into the buffer it
        # was captured with, and freeing it would hand that memory to other tensors (found on H100: graph
        # replays overwrote the KV slot indices the radix cache was freeing).
        self._retired: list[torch.Tensor] = []

    # ----------------------------------------------------------------- metadata
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> TritonAttnMetadata:
        """Build the batch's :class:`TritonAttnMetadata`, store it as ``forward_batch.attn_metadata`` and
        return it.

        Decode batches use the ForwardBatch's tensors as they are (no copies, no host sync: CUDA-graph
        safe). Mixed batches split their rows by extend length from the ``*_cpu`` lists: rows with one new
        token go to the decode kernel (K/V read once per query-head group), the others to the extend
        kernel; the row index tensors are built here once per batch, not per layer, with one asynchronous
        pinned host-to-device copy (no host sync, so TokenWeave's second split can be prepared while the
        device still runs earlier work).
        """
        fb = forward_batch
        bs = fb.batch_size
        pool = fb.token_to_kv_pool
        if fb.forward_mode.is_decode():
            splits = self.num_kv_splits(bs, pool.head_num, pool.device)
            meta = TritonAttnMetadata(
                is_decode=True, num_kv_splits=splits,
                max_extend_len=1, num_decode=bs, req_pool_indices=None, prefix_lens=None, extend_lens=None,
                extend_start_loc=None, decode_req_pool_indices=fb.req_pool_indices, decode_seq_lens=fb.seq_lens,
                decode_token_index=None, **self._balanced(fb.seq_lens, splits))
            fb.attn_metadata = meta
            return meta
        lens = fb.extend_lens_cpu
        dec_rows = [i for i, e in enumerate(lens) if e == 1]
        if fb.forward_mode != ForwardMode.MIXED or not dec_rows or len(dec_rows) == bs:
            dec_rows = []  # plain extend (or all-ones extend): one extend launch, no index copies
        dec_set = set(dec_rows)
        ext_rows = [i for i in range(bs) if i not in dec_set]
        dense: list = []
        if self.extend_impl != "triton":  # prefix-free prefill rows go to PyTorch's fused attention
            starts = [0] * bs
            for i in range(1, bs):
                starts[i] = starts[i - 1] + lens[i - 1]
            dense_rows = {i for i in ext_rows if fb.prefix_lens_cpu[i] == 0 and lens[i] > 1}
            dense = [(starts[i], lens[i]) for i in sorted(dense_rows)]
            ext_rows = [i for i in ext_rows if i not in dense_rows]
        if not dec_rows and not dense:
            meta = TritonAttnMetadata(
                is_decode=False, num_kv_splits=1, max_extend_len=max(lens, default=0), num_decode=0,
                req_pool_indices=fb.req_pool_indices, prefix_lens=fb.prefix_lens, extend_lens=fb.extend_lens,
                extend_start_loc=fb.extend_start_loc, decode_req_pool_indices=None, decode_seq_lens=None,
                decode_token_index=None)
            fb.attn_metadata = meta
            return meta
        dev = fb.req_pool_indices.device
        dec, ext = torch.split(ints_to_device(dec_rows + ext_rows, dev), [len(dec_rows), len(ext_rows)])
        dec_fields = dict(decode_req_pool_indices=None, decode_seq_lens=None, decode_token_index=None)
        splits = 1
        if dec_rows:
            splits = self.num_kv_splits(len(dec_rows), pool.head_num, pool.device)
            dec_seq = fb.seq_lens[dec]
            dec_fields = dict(decode_req_pool_indices=fb.req_pool_indices[dec], decode_seq_lens=dec_seq,
                              decode_token_index=fb.extend_start_loc[dec], **self._balanced(dec_seq, splits))
        ext_fields = dict(req_pool_indices=None, prefix_lens=None, extend_lens=None, extend_start_loc=None)
        if ext_rows:
            ext_fields = dict(req_pool_indices=fb.req_pool_indices[ext], prefix_lens=fb.prefix_lens[ext],
                              extend_lens=fb.extend_lens[ext], extend_start_loc=fb.extend_start_loc[ext])
        meta = TritonAttnMetadata(
            is_decode=False, num_kv_splits=splits, max_extend_len=max((lens[i] for i in ext_rows), default=0),
            num_decode=len(dec_rows), dense_segments=tuple(dense), **ext_fields, **dec_fields)
        fb.attn_metadata = meta
        return meta

    def _balanced(self, seq_lens: torch.Tensor, splits: int) -> dict:
        """The ``balanced`` policy's metadata fields for decode rows of ``seq_lens`` (empty for other policies)."""
        if self.split_policy != "balanced":
            return {}
        return {"decode_order": decode_row_order(seq_lens),
                "min_split_len": BALANCED_MIN_SPLIT_LEN if splits > 1 else 0}

    def num_kv_splits(self, batch_size: int, num_kv_heads: int, device: torch.device) -> int:
        """Decode splits per (request, KV head) for a batch of ``batch_size`` decode rows (this backend's policy,
        see :func:`~sgl_kernel.triton.decode_attention.default_num_kv_splits`); fixed per batch size, so CUDA
        graphs captured at that size replay with it."""
        return default_num_kv_splits(batch_size, num_kv_heads, device, MAX_KV_SPLITS, policy=self.split_policy)

    def init_cuda_graph_state(self, max_bs: int, num_heads: int, head_dim: int, num_kv_heads: int,
                              device: torch.device) -> None:
        """Preallocate the decode split workspace for every batch size up to ``max_bs``.

        Call before capturing CUDA graphs so that no capture allocates it. ``num_heads``/``num_kv_heads``
        are per rank. Raises ValueError for non-positive sizes.
        """
        if min(max_bs, num_heads, head_dim, num_kv_heads) <= 0:
            raise ValueError(f"init_cuda_graph_state: sizes must be > 0, got max_bs={max_bs}, "
                             f"num_heads={num_heads}, head_dim={head_dim}, num_kv_heads={num_kv_heads}")
        device = torch.device(device)
        need = max(bs * self.num_kv_splits(bs, num_kv_heads, device) for bs in range(1, max_bs + 1))
        self._get_workspace(need, num_heads, head_dim, device)

    def _get_workspace(self, rows: int, num_heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
        """Flat fp32 buffer of at least ``rows * num_heads * (head_dim + 1)`` floats (grown on demand; a buffer
        once handed out stays allocated for the backend's lifetime, since CUDA graphs may hold its address)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (num_heads, head_dim, device)
        need = rows * num_heads * (head_dim + 1)
        buf = self._workspace.get(key)
        if buf is None or buf.numel() < need:
            if buf is not None:
                self._retired.append(buf)  # never freed: graphs captured on it still replay into it
            buf = torch.empty(need, dtype=torch.float32, device=device)
            self._workspace[key] = buf
        return buf

    # ------------------------------------------------------------------ forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                forward_batch: "ForwardBatch", rope: Optional[tuple] = None) -> torch.Tensor:
        """q [N, nh*hd], k/v [N, nkv*hd] (row-strided views allowed) -> [N, nh*hd] in q's dtype (writes k/v to the
        pool first).

        ``rope``: ``(positions [N] int64, RotaryEmbedding)`` when q and k are not rotated yet (see
        :meth:`RadixAttention.forward`): RoPE and the KV-cache store then run as one kernel
        (:func:`sglang.srt.layers.ops.rope_and_store_kv`; an FP8 pool is quantized with the layer's scales inside
        it) unless this backend was built with ``fused_rope=False``, where RoPE runs first.
        FP8 pools (``--kv-cache-dtype fp8_*``): both kernels read the FP8 K/V tiles and dequantize them in registers
        with the layer's scales (:meth:`MHATokenToKVPool.k_scale` / ``v_scale``).
        Raises:
            ValueError: :meth:`init_forward_metadata` was not called for this batch, or shapes disagree.
        """
        meta = forward_batch.attn_metadata
        if not isinstance(meta, TritonAttnMetadata):
            raise ValueError("TritonAttnBackend.forward: call init_forward_metadata(forward_batch) before the layers run")
        nh, nkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
        pool = forward_batch.token_to_kv_pool
        ks, vs = pool.k_scale(layer.layer_id), pool.v_scale(layer.layer_id)
        if rope is not None and self.fused_rope and _plain_rope(rope[1]):
            positions, rotary = rope
            k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
            if k.shape[0] != forward_batch.out_cache_loc.shape[0]:
                raise ValueError(f"TritonAttnBackend: {k.shape[0]} new tokens but out_cache_loc has "
                                 f"{forward_batch.out_cache_loc.shape[0]} slots")
            ops.rope_and_store_kv(positions, q, k, v, rotary.cos_sin_cache, rotary.head_dim, rotary.is_neox_style,
                                  k_buf, v_buf, forward_batch.out_cache_loc, ks, vs)
        else:
            if rope is not None:
                q, k = rope[1](rope[0], q, k)
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k.reshape(-1, nkv, hd),
                               v.reshape(-1, nkv, hd))
            k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        q3 = q.reshape(-1, nh, hd)
        if q3.stride(-1) != 1:
            q3 = q3.contiguous()
        out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
        if meta.is_decode:
            if q3.shape[0] != meta.num_decode:
                raise ValueError(f"TritonAttnBackend: decode batch has {meta.num_decode} requests but "
                                 f"{q3.shape[0]} query rows")
            self._decode(q3, out, k_buf, v_buf, req_to_token, meta, layer, ks, vs)
            return out.view(-1, nh * hd)
        if meta.req_pool_indices is not None and meta.max_extend_len > 0:
            extend_attention_fwd(q3, out, k_buf, v_buf, req_to_token, meta.req_pool_indices, meta.prefix_lens,
                                 meta.extend_lens, meta.extend_start_loc, meta.max_extend_len, layer.scaling,
                                 k_scale=ks, v_scale=vs)
        if meta.dense_segments:
            prefix_free_attention(q3, out, k_buf, v_buf, forward_batch.out_cache_loc, meta.dense_segments,
                                  layer.scaling, self.extend_impl, k_scale=ks, v_scale=vs)
        if meta.num_decode:
            qd = q3.index_select(0, meta.decode_token_index)
            od = torch.empty_like(qd)
            self._decode(qd, od, k_buf, v_buf, req_to_token, meta, layer, ks, vs)
            out.index_copy_(0, meta.decode_token_index, od)
        return out.view(-1, nh * hd)

    def _decode(self, q3: torch.Tensor, out: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                req_to_token: torch.Tensor, meta: TritonAttnMetadata, layer: "RadixAttention", k_scale: float = 1.0,
                v_scale: float = 1.0) -> None:
        bs, nh, hd = q3.shape
        splits = meta.num_kv_splits
        ws = self._get_workspace(bs * splits, nh, hd, q3.device)
        mid_o = ws[: bs * nh * splits * hd].view(bs, nh, splits, hd)
        mid_lse = ws[bs * nh * splits * hd: bs * nh * splits * (hd + 1)].view(bs, nh, splits)
        decode_attention_fwd(q3, k_buf, v_buf, out, req_to_token, meta.decode_req_pool_indices,
                             meta.decode_seq_lens, layer.scaling, splits, mid_o, mid_lse, legacy=self.legacy_decode,
                             order=meta.decode_order, min_split_len=meta.min_split_len, k_scale=k_scale,
                             v_scale=v_scale)
