"""FlashInfer attention backend over the paged KV pool (``--attention-backend flashinfer``; optional extra).

Kernels: FlashInfer's paged-KV wrappers (Ye et al. 2025, "FlashInfer: Efficient and Customizable Attention Engine
for LLM Inference Serving": the page-table KV format of sec. 3.1, the plan/run split of sec. 3.3, FA2 kernels). A
batch whose rows all add one token runs ``BatchDecodeWithPagedKVCacheWrapper`` (tensor-core decode when the GQA group
is >= 4, as SGLang picks, which reuses the prefill module); any other batch (extend, chunked prefill, mixed)
runs ``BatchPrefillWithPagedKVCacheWrapper`` with a causal mask over the paged KV, so a request's cached prefix (the
radix cache's hit) and its new tokens are read from the same pages: new K/V are stored in the pool first, then
query row ``i`` of a request with ``kv_len`` keys and ``qo_len`` new tokens sees keys ``0 .. kv_len - qo_len + i``.

Page tables: the pool's page size (``--page-size``, 1 or more) is FlashInfer's page size; a layer's K (or V) buffer
``[slots, kv_heads, head_dim]`` is viewed as ``[slots // page_size, page_size, kv_heads, head_dim]`` (a strided view,
either pool layout), and :func:`sgl_kernel.triton.page_table.build_page_table` gathers each request's page ids from
``req_to_token`` on the device. ``kv_indptr`` / ``kv_last_page_len`` / ``qo_indptr`` come from the batch's host
lists (no device sync). A plan is made once per batch, at its first layer (the softmax scale comes from the layer),
and reused by every layer.

CUDA graphs (decode): :meth:`init_graph_metadata` gives each captured batch size its own decode wrapper on fixed
index buffers; :meth:`plan_graph_replay` re-plans it (host work and small copies only) before every replay with the
replayed batch's sequence lengths, and the page-table kernel refills the fixed index buffer from the static
``req_pool_indices`` staged for that replay.

Import: this module imports ``flashinfer`` when the backend is created, never earlier; the server refuses
``--attention-backend flashinfer`` before any worker starts when it is not installed (``ServerArgs``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from sglang.srt.layers import ops
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.rotary_embedding import RotaryEmbedding

if TYPE_CHECKING:
    from sglang.srt.forward_batch_info import ForwardBatch
    from sglang.srt.layers.radix_attention import RadixAttention

logger = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "sglang[flashinfer]" (or: pip install flashinfer-python apache-tvm-ffi)'
WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace (split-KV partial outputs), shared by all wrappers
TENSOR_CORE_GQA = 4  # decode on tensor cores (the prefill kernel) from this query-per-KV-head group size up
EAGER_WRAPPERS = 4  # wrappers of each kind in turn for eager batches (a plan lives until its batch has run)


def import_flashinfer():
    """The ``flashinfer`` module. Raises ImportError naming the install command when it is not installed."""
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(f"--attention-backend flashinfer needs FlashInfer: {INSTALL_HINT} ({e})") from e
    return flashinfer


@dataclass
class FlashInferMetadata:
    """One batch's plan inputs (host lists and device page table), stored as ``forward_batch.attn_metadata``.

    ``wrapper``: the decode or prefill wrapper this batch is planned on; ``planned``: its plan was made (at the first
    layer). Host tensors (int32, CPU): ``qo_indptr [bs + 1]`` (prefill only), ``kv_indptr [bs + 1]``,
    ``kv_last_page_len [bs]``. Device: ``kv_indices`` (int32 page ids, ``kv_indptr[-1]`` of them).
    """

    decode: bool
    wrapper: Any
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: Optional[torch.Tensor] = None
    graph_bs: int = 0
    planned: bool = False


def _plain_rope(rotary) -> bool:
    return isinstance(rotary, RotaryEmbedding) and type(rotary).forward is RotaryEmbedding.forward


def _host_index_arrays(seq_lens: list[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_indptr [bs + 1], kv_last_page_len [bs])`` int32 on the host for requests of ``seq_lens`` tokens."""
    n = torch.tensor(seq_lens, dtype=torch.int64)
    pages = (n + page_size - 1) // page_size
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    return indptr, ((n - 1) % page_size + 1).to(torch.int32)


class FlashInferAttnBackend(AttentionBackend):
    """FlashInfer paged attention (see the module doc and :class:`AttentionBackend` for the contract).

    Tensors on CUDA; q in float16 or bfloat16, the pool in q's dtype or FP8; any head_dim FlashInfer compiles (64,
    128, 256 are its usual ones) and any GQA ratio. The first batch of each kind (decode, prefill) JIT-compiles
    FlashInfer's module for the model's shapes (cached under ``~/.cache/flashinfer``).

    Raises:
        ImportError: flashinfer is not installed (names the install command).
    """

    fuses_rope_kv_store = True

    def __init__(self) -> None:
        self.fi = import_flashinfer()
        self._workspace: dict[torch.device, torch.Tensor] = {}
        self._int_workspace: dict[torch.device, torch.Tensor] = {}
        self._eager: dict[tuple[torch.device, str], list] = {}
        self._turn: dict[tuple[torch.device, str], int] = {}
        self._graphs: dict[int, Any] = {}  # captured batch size -> its decode wrapper (use_cuda_graph)
        self._graph_indices: Optional[torch.Tensor] = None  # the page ids every graph wrapper reads (shared)
        self._graph_scratch: Optional[torch.Tensor] = None  # where the page-table kernel writes them before a plan
        self._heads: Optional[tuple[int, int, int]] = None  # (num_heads, num_kv_heads, head_dim) per rank
        self.sm_scale: Optional[float] = None  # the layers' softmax scale, read at the first plan
        self.q_dtype: Optional[torch.dtype] = None
        self._planned: dict[int, Any] = {}  # id(wrapper) -> CUDA event after its last plan's copies were issued

    # ----------------------------------------------------------------- wrappers
    def _ws(self, device: torch.device) -> torch.Tensor:
        if device not in self._workspace:
            self._workspace[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace[device]

    def _tensor_cores(self) -> bool:
        nh, nkv, _ = self._heads
        return nh // max(nkv, 1) >= TENSOR_CORE_GQA

    def _eager_wrapper(self, device: torch.device, decode: bool):
        """The next of :data:`EAGER_WRAPPERS` wrappers of the kind (each batch keeps its plan until it has run)."""
        kind = "decode" if decode else "prefill"
        key = (device, kind)
        ring = self._eager.setdefault(key, [])
        i = self._turn.get(key, 0)
        self._turn[key] = (i + 1) % EAGER_WRAPPERS
        if i >= len(ring):
            if decode:
                w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self._ws(device), "NHD",
                                                               use_tensor_cores=self._tensor_cores(), backend="fa2")
            else:
                w = self.fi.BatchPrefillWithPagedKVCacheWrapper(self._ws(device), "NHD", backend="fa2")
            ring.append(w)
        return ring[i]

    # ----------------------------------------------------------------- metadata
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> FlashInferMetadata:
        """Build the batch's :class:`FlashInferMetadata` (host index arrays from the batch's host lists, page ids
        gathered on the device, no host sync), store it as ``forward_batch.attn_metadata`` and return it. The plan
        is made at the first layer (:meth:`forward`)."""
        from sgl_kernel.triton.page_table import build_page_table

        fb = forward_batch
        pool = fb.token_to_kv_pool
        dev = fb.req_pool_indices.device
        decode = fb.forward_mode.is_decode()
        kv_indptr, last = _host_index_arrays(list(fb.seq_lens_cpu), pool.page_size)
        indices = torch.empty(int(kv_indptr[-1]), dtype=torch.int32, device=dev)
        build_page_table(fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                         kv_indptr.to(dev, non_blocking=True), pool.page_size, indices)
        qo = None
        if not decode:
            qo = torch.zeros(fb.batch_size + 1, dtype=torch.int32)
            qo[1:] = torch.cumsum(torch.tensor(list(fb.extend_lens_cpu), dtype=torch.int64), 0)
        meta = FlashInferMetadata(decode=decode, wrapper=None, kv_indptr=kv_indptr, kv_last_page_len=last,
                                  kv_indices=indices, qo_indptr=qo)
        fb.attn_metadata = meta
        return meta

    def init_cuda_graph_state(self, max_bs: int, num_heads: int, head_dim: int, num_kv_heads: int,
                              device: torch.device) -> None:
        """Record the per-rank head counts and make the workspaces before graphs are captured.

        Raises:
            ValueError: a non-positive size.
        """
        if min(max_bs, num_heads, head_dim, num_kv_heads) <= 0:
            raise ValueError(f"init_cuda_graph_state: sizes must be > 0, got max_bs={max_bs}, "
                             f"num_heads={num_heads}, head_dim={head_dim}, num_kv_heads={num_kv_heads}")
        device = torch.device(device)
        self._heads = (num_heads, num_kv_heads, head_dim)
        self._ws(device)
        if device not in self._int_workspace:  # one plan buffer for every graph wrapper (each replay re-plans)
            self._int_workspace[device] = torch.empty(8 << 20, dtype=torch.uint8, device=device)

    def init_graph_metadata(self, forward_batch: "ForwardBatch") -> FlashInferMetadata:
        """The metadata of the decode batch a CUDA graph of ``forward_batch.batch_size`` rows is captured on: its own
        decode wrapper (``use_cuda_graph=True``) on fixed index buffers (the page-id buffer shared by all graphs,
        sized at the first, largest, capture for ``batch_size`` full-context requests, plus a scratch buffer of the
        same size the page-table kernel fills before each plan), planned at the first layer
        of the warm-up forward and re-planned before each replay by :meth:`plan_graph_replay`.

        Raises:
            ValueError: :meth:`init_cuda_graph_state` was not called first.
        """
        fb = forward_batch
        bs, pool = fb.batch_size, fb.token_to_kv_pool
        dev = fb.req_pool_indices.device
        if self._heads is None or dev not in self._int_workspace:
            raise ValueError("FlashInferAttnBackend: call init_cuda_graph_state before capturing graphs")
        ps, ctx = pool.page_size, fb.req_to_token_pool.req_to_token.shape[1]
        need = bs * ((ctx + ps - 1) // ps)
        if self._graph_indices is None or self._graph_indices.numel() < need:
            self._graph_indices = torch.zeros(need, dtype=torch.int32, device=dev)
            self._graph_scratch = torch.zeros(need, dtype=torch.int32, device=dev)
        wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self._ws(dev), "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_cores(),
            paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=dev), backend="fa2")
        wrapper.reset_workspace_buffer(self._ws(dev), self._int_workspace[dev])
        self._graphs[bs] = wrapper
        meta = self._graph_meta(fb, list(fb.seq_lens_cpu))
        fb.attn_metadata = meta
        return meta

    def _graph_meta(self, fb: "ForwardBatch", seq_lens: list[int]) -> FlashInferMetadata:
        from sgl_kernel.triton.page_table import build_page_table

        pool = fb.token_to_kv_pool
        kv_indptr, last = _host_index_arrays(seq_lens, pool.page_size)
        n = int(kv_indptr[-1])
        if n > self._graph_indices.numel():
            raise ValueError(f"FlashInferAttnBackend: {n} pages exceed the graphs' page-id buffer "
                             f"({self._graph_indices.numel()})")
        dev = self._graph_scratch.device
        # the plan copies these into the wrapper's fixed buffer (never a buffer onto itself)
        indices = build_page_table(fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                                   kv_indptr.to(dev, non_blocking=True), pool.page_size, self._graph_scratch)[:n]
        return FlashInferMetadata(decode=True, wrapper=self._graphs[fb.batch_size], kv_indptr=kv_indptr,
                                  kv_last_page_len=last, kv_indices=indices, graph_bs=fb.batch_size)

    def plan_graph_replay(self, forward_batch: "ForwardBatch", seq_lens: list[int]) -> None:
        """Before replaying the graph captured on ``forward_batch`` (its static buffers already staged): gather the
        page ids of ``seq_lens`` (host, one per row, padding rows included) into the graphs' page-id buffer and
        re-plan that graph's decode wrapper.

        Raises:
            ValueError: no graph of that batch size was captured and planned.
        """
        if forward_batch.batch_size not in self._graphs or self.sm_scale is None:
            raise ValueError(f"FlashInferAttnBackend.plan_graph_replay: no captured, planned graph for batch "
                             f"{forward_batch.batch_size}")
        self._plan(self._graph_meta(forward_batch, seq_lens), forward_batch.token_to_kv_pool)

    def _plan(self, meta: FlashInferMetadata, pool) -> None:
        """Plan ``meta.wrapper`` for the batch. A wrapper's plan goes to the device through its own pinned host
        buffer (asynchronously), so before re-planning a wrapper the copy of its previous plan must have run: the
        event recorded after that plan is waited for (normally long done)."""
        nh, nkv, hd = self._heads
        done = self._planned.get(id(meta.wrapper))
        if done is not None:
            done.synchronize()
        kw = dict(q_data_type=self.q_dtype, kv_data_type=pool.dtype, sm_scale=self.sm_scale)
        if meta.decode:
            meta.wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, nh, nkv, hd, pool.page_size,
                              **kw)
        else:
            meta.wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, nh, nkv, hd,
                              pool.page_size, causal=True, **kw)
        meta.planned = True
        if pool.device.type == "cuda":
            ev = self._planned.setdefault(id(meta.wrapper), torch.cuda.Event())
            ev.record()

    # ------------------------------------------------------------------ forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                forward_batch: "ForwardBatch", rope: Optional[tuple] = None) -> torch.Tensor:
        """q [N, nh*hd], k/v [N, nkv*hd] -> [N, nh*hd] in q's dtype; stores k/v in the pool first (RoPE fused with
        the store when ``rope`` is given, as the Triton backend does; an FP8 pool is quantized with the layer's
        scales, :meth:`MHATokenToKVPool.k_scale` / ``v_scale``); the batch is planned at its first layer.
        FP8 pools (``--kv-cache-dtype fp8_*``): the plan names the FP8 KV dtype and the run gets the layer's
        ``k_scale`` / ``v_scale`` (FlashInfer multiplies the softmax scale by ``k_scale`` and the output by
        ``v_scale``, the same dequantization as the Triton kernels).

        Raises:
            ValueError: :meth:`init_forward_metadata` was not called for this batch.
        """
        meta = forward_batch.attn_metadata
        if not isinstance(meta, FlashInferMetadata):
            raise ValueError("FlashInferAttnBackend.forward: call init_forward_metadata(forward_batch) first")
        nh, nkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
        pool = forward_batch.token_to_kv_pool
        ks, vs = pool.k_scale(layer.layer_id), pool.v_scale(layer.layer_id)
        if rope is not None and _plain_rope(rope[1]):
            positions, rotary = rope
            k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
            ops.rope_and_store_kv(positions, q, k, v, rotary.cos_sin_cache, rotary.head_dim, rotary.is_neox_style,
                                  k_buf, v_buf, forward_batch.out_cache_loc, ks, vs)
        else:
            if rope is not None:
                q, k = rope[1](rope[0], q, k)
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k.reshape(-1, nkv, hd),
                               v.reshape(-1, nkv, hd))
            k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        if not meta.planned:
            self._heads, self.sm_scale, self.q_dtype = (nh, nkv, hd), layer.scaling, q.dtype
            if meta.wrapper is None:
                meta.wrapper = self._eager_wrapper(q.device, meta.decode)
            self._plan(meta, pool)
        ps = pool.page_size
        pages = k_buf.shape[0] // ps
        k_pages = k_buf[: pages * ps].unflatten(0, (pages, ps))  # [pages, page_size, kv_heads, head_dim], strided
        v_pages = v_buf[: pages * ps].unflatten(0, (pages, ps))
        q3 = q.reshape(-1, nh, hd)
        out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
        # FP8 pool: FlashInfer folds k_scale into the softmax scale and multiplies the output by v_scale (its run()
        # contract); the kernels widen the FP8 pages in registers. Unscaled pools pass neither (the BF16 call as is).
        scales = dict(k_scale=ks, v_scale=vs) if pool.scales is not None else {}
        meta.wrapper.run(q3, (k_pages, v_pages), out=out, **scales)
        return out.view(-1, nh * hd)
