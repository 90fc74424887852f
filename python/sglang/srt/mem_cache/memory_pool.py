"""KV memory pools: the request -> token map and the per-layer K/V buffers.

Two-level mapping used by SGLang (and vLLM's PagedAttention, Kwon et al. 2023, section 4):

* ``ReqToTokenPool``: one row per running request; entry ``[r, p]`` is the KV slot that
  holds position ``p`` of request ``r``.
* ``MHATokenToKVPool``: per layer, a K and a V buffer indexed by KV slot (layer-major or token-major storage).

Slot bookkeeping (which slots are free) lives in ``allocator.TokenToKVPoolAllocator``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Optional, Tuple, Union

import torch

from sglang.srt.mem_cache.kv_quant import KVScales, describe_format, is_fp8, quantize_kv
from sglang.srt.utils.tensor_transfer import host_to_device

if TYPE_CHECKING:
    from sglang.srt.mem_cache.kv_descriptor import KVRegionDescriptor

logger = logging.getLogger(__name__)


class ReqToTokenPool:
    """Maps (request slot, token position) -> KV slot.

    Args:
        size: number of request slots (max concurrently running requests), > 0.
        max_context_len: longest sequence (tokens) a request may hold, > 0.
        device: device of ``req_to_token``.

    Attributes:
        req_to_token: int32 tensor ``[size, max_context_len]`` on ``device``; row ``r`` is
            only meaningful for the positions the owner of slot ``r`` has filled.

    Raises:
        ValueError: ``size`` or ``max_context_len`` is not positive.
    """

    def __init__(self, size: int, max_context_len: int, device: Union[str, torch.device]):
        if size <= 0:
            raise ValueError(f"ReqToTokenPool size={size} must be > 0; pass --max-running-requests >= 1")
        if max_context_len <= 0:
            raise ValueError(f"ReqToTokenPool max_context_len={max_context_len} must be > 0; pass --context-length >= 1")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self._free_slots: List[int] = []
        self._is_free: List[bool] = []
        self.clear()

    def available_size(self) -> int:
        """Number of free request slots."""
        return len(self._free_slots)

    def alloc(self, n: int = 1) -> Optional[List[int]]:
        """Take ``n`` free request slots; returns their row indices, or None (taking nothing) if fewer are free.

        Raises:
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"ReqToTokenPool.alloc(n={n}): n must be >= 0")
        if n > len(self._free_slots):
            return None
        taken = self._free_slots[:n]
        del self._free_slots[:n]
        for i in taken:
            self._is_free[i] = False
        return taken

    def free(self, idx: Union[int, List[int]]) -> None:
        """Return request slot(s) to the pool.

        Raises:
            ValueError: an index is out of range or already free (double free); nothing is freed then.
        """
        items = [int(i) for i in idx] if isinstance(idx, (list, tuple)) else [int(idx)]
        seen = set()
        for i in items:
            if not 0 <= i < self.size:
                raise ValueError(f"ReqToTokenPool.free: index {i} out of range [0, {self.size})")
            if self._is_free[i] or i in seen:
                raise ValueError(f"ReqToTokenPool.free: request slot {i} is already free (double free)")
            seen.add(i)
        for i in items:
            self._is_free[i] = True
            self._free_slots.append(i)

    def write(self, idx: int, start: int, values: torch.Tensor) -> None:
        """Set ``req_to_token[idx, start:start + len(values)] = values`` (any integer dtype, cast to int32).

        Raises:
            ValueError: the range runs past ``max_context_len``.
        """
        end = start + values.numel()
        if start < 0 or end > self.max_context_len:
            raise ValueError(
                f"ReqToTokenPool.write: positions [{start}, {end}) exceed max_context_len={self.max_context_len}; "
                "raise --context-length or shorten the request"
            )
        self.req_to_token[idx, start:end] = values.to(device=self.device, dtype=torch.int32)

    def write_batch(self, rows: List[int], starts: List[int], lens: List[int], values: torch.Tensor) -> None:
        """For every i, set ``req_to_token[rows[i], starts[i]:starts[i] + lens[i]]`` to the next ``lens[i]``
        entries of ``values``, in one indexed store (one host-to-device copy of the indices).

        Args:
            rows, starts, lens: per request: its pool row, first position written, number written.
            values: ``[sum(lens)]`` KV slots (any integer dtype, on any device), the requests' runs
                concatenated in order.
        Raises:
            ValueError: the lists differ in length, ``values`` has the wrong size, or a range runs
                outside ``[0, max_context_len)``.
        """
        n_req = len(rows)
        if len(starts) != n_req or len(lens) != n_req:
            raise ValueError(f"ReqToTokenPool.write_batch: rows ({n_req}), starts ({len(starts)}) and lens "
                             f"({len(lens)}) must have the same length")
        total = sum(lens)
        if values.numel() != total:
            raise ValueError(f"ReqToTokenPool.write_batch: {values.numel()} values for sum(lens)={total}")
        for st, ln in zip(starts, lens):
            if st < 0 or ln < 0 or st + ln > self.max_context_len:
                raise ValueError(
                    f"ReqToTokenPool.write_batch: positions [{st}, {st + ln}) exceed max_context_len="
                    f"{self.max_context_len}; raise --context-length or shorten the request")
        if total == 0:
            return
        if all(ln == 1 for ln in lens):  # decode: one position per request
            idx = torch.tensor([rows, starts], dtype=torch.int64)
        else:
            ln_t = torch.tensor(lens, dtype=torch.int64)
            first = torch.cumsum(ln_t, 0) - ln_t  # offset of each request's run in ``values``
            col = torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(
                torch.tensor(starts, dtype=torch.int64) - first, ln_t)
            idx = torch.stack([torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), ln_t), col])
        idx = host_to_device(idx, self.device)
        self.req_to_token[idx[0], idx[1]] = host_to_device(values.reshape(-1), self.device, torch.int32)

    def clear(self) -> None:
        """Mark every request slot free (row contents are left as they are)."""
        self._free_slots = list(range(self.size))
        self._is_free = [True] * self.size


#: Storage orders of :class:`MHATokenToKVPool` (dimension names, outermost first; see its docstring).
KV_LAYOUTS = {
    "layer_major": ("layer", "kv", "slot", "head", "head_dim"),
    "token_major": ("slot", "layer", "kv", "head", "head_dim"),
}
#: The order :attr:`MHATokenToKVPool.kv_layer_view` presents, whatever the storage order.
LAYER_VIEW_DIMS = KV_LAYOUTS["layer_major"]


class MHATokenToKVPool:
    """Per-layer K and V buffers for multi-head (incl. grouped-query) attention, in one contiguous region.

    Storage: one row-major tensor ``kv_data`` whose dims (kv 0 = K, 1 = V) depend on ``layout``:

    * ``"layer_major"`` (default, aggregated serving and push-mode PD): ``[layer_num, 2, size + page_size,
      head_num, head_dim]``. The K (or V) of one page of one layer is one contiguous run of
      ``page_size * head_num * head_dim`` elements, so a layer's KV of a request is one range per K/V (what a
      layerwise push WRITEs as soon as that layer is stored).
    * ``"token_major"`` (pull-mode PD): ``[size + page_size, layer_num, 2, head_num, head_dim]``. The KV of one
      slot across **all** layers is one contiguous run of ``layer_num * 2 * head_num * head_dim`` elements, so a
      request's run of consecutive slots is ONE byte range: one transfer descriptor per slot run instead of
      ``2 * layer_num`` (64 for Llama-3.1-8B). Why: UCX handles NIXL descriptors one after the other at ~9-10 us
      each (``benchmark/disaggregation/bench_nixl_read.py``); KVDirect (Chen et al. 2024, sec. 4.2) coalesces reads
      for the same reason.

    :meth:`describe` publishes the storage order and strides (KVDirect's tensor-centric metadata), so a peer
    with the other layout still computes correct byte ranges (just more of them). Buffers, whatever the
    layout: ``kv_layer_view`` is ``kv_data`` viewed as ``[layer_num, 2, size + page_size, head_num, head_dim]``
    (a permutation, not a copy), ``k_buffer[l] = kv_layer_view[l, 0]`` and ``v_buffer[l] = kv_layer_view[l, 1]``
    are views of shape ``[size + page_size, head_num, head_dim]`` with ``(head, head_dim)`` dense and a slot
    stride of ``head_num * head_dim`` elements (layer_major, contiguous) or ``layer_num * 2 * head_num *
    head_dim`` (token_major, strided); consumers (attention kernels, indexed stores) must use their strides.
    dtype ``dtype`` (FP8 dtypes are stored as uint8 and viewed back on read, because indexed writes into float8
    tensors are not supported everywhere), on ``device``. Slots ``0 .. page_size-1`` form a reserved dummy page
    used for padding writes; the allocator never hands them out.

    FP8 caches (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``, :mod:`~sglang.srt.mem_cache.kv_quant`): one byte per
    element (twice the slots of a BF16 pool for the same bytes) and one FP32 scale per layer for K and one for V
    (``scales``; 1.0 by default). :meth:`set_kv_buffer` stores ``fp8(clamp(x / scale))``; readers dequantize with
    :meth:`k_scale` / :meth:`v_scale` (the Triton kernels fold them into the softmax scale and the output, in
    registers; the torch reference multiplies the gathered values).

    Args:
        size: number of usable token slots (the allocator uses ``size // page_size`` whole pages).
        page_size: tokens per page, >= 1.
        dtype: KV cache dtype (e.g. ``torch.bfloat16``).
        head_num: KV heads held by this rank.
        head_dim: head dimension.
        layer_num: number of attention layers held by this rank.
        device: buffer device.
        layout: ``"layer_major"`` or ``"token_major"`` (a key of :data:`KV_LAYOUTS`; chosen by
            ``ServerArgs.resolved_kv_cache_layout``, ``--kv-cache-layout``).
        scales: per-layer K/V scales of an FP8 ``dtype`` (:class:`~sglang.srt.mem_cache.kv_quant.KVScales` of
            ``layer_num`` layers); None: 1.0 for FP8, and the only choice for other dtypes.

    Raises:
        ValueError: any size argument is not positive, an unknown ``layout``, scales for a non-FP8 dtype, or scales
            of another layer count.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: Union[str, torch.device], layout: str = "layer_major",
                 scales: Optional[KVScales] = None):
        for name, val in (("size", size), ("page_size", page_size), ("head_num", head_num),
                          ("head_dim", head_dim), ("layer_num", layer_num)):
            if val <= 0:
                raise ValueError(f"MHATokenToKVPool {name}={val} must be > 0")
        if layout not in KV_LAYOUTS:
            raise ValueError(f"MHATokenToKVPool layout={layout!r}: use one of {sorted(KV_LAYOUTS)}")
        if scales is not None and not is_fp8(dtype):
            raise ValueError(f"MHATokenToKVPool: K/V scales are only for FP8 caches, not {dtype}")
        if scales is not None and scales.num_layers != layer_num:
            raise ValueError(f"MHATokenToKVPool: scales of {scales.num_layers} layers for {layer_num} layers")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = torch.uint8 if is_fp8(dtype) else dtype
        self.scales: Optional[KVScales] = (scales or KVScales.unit(layer_num)) if is_fp8(dtype) else None
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.layout = layout
        self.dims = KV_LAYOUTS[layout]
        extent = {"layer": layer_num, "kv": 2, "slot": size + page_size, "head": head_num, "head_dim": head_dim}
        self.kv_data = torch.zeros([extent[d] for d in self.dims], dtype=self.store_dtype, device=self.device)
        self.kv_layer_view = self.kv_data.permute([self.dims.index(d) for d in LAYER_VIEW_DIMS])
        self.k_buffer = [self.kv_layer_view[layer, 0] for layer in range(layer_num)]
        self.v_buffer = [self.kv_layer_view[layer, 1] for layer in range(layer_num)]
        logger.info("KV pool: %d slots x %d layers, %.2f GiB (%s), %s layout %s", size, layer_num,
                    self.kv_size_bytes() / 2**30, describe_format(dtype, self.scales), layout, self.dims)

    @staticmethod
    def bytes_per_token(head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        """Bytes of K plus V per token slot across all layers (use to size the pool from a memory budget; the same
        for every layout)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * head_num * head_dim * layer_num * elem

    def k_scale(self, layer_id: int) -> float:
        """FP32 scale of layer ``layer_id``'s K cache (stored value x scale = K); 1.0 for non-FP8 pools."""
        return self.scales.k[layer_id] if self.scales is not None else 1.0

    def v_scale(self, layer_id: int) -> float:
        """FP32 scale of layer ``layer_id``'s V cache; 1.0 for non-FP8 pools."""
        return self.scales.v[layer_id] if self.scales is not None else 1.0

    def kv_size_bytes(self) -> int:
        """Total bytes of all K and V buffers (dummy page included)."""
        return self.kv_data.numel() * self.kv_data.element_size()

    def describe(self) -> "KVRegionDescriptor":
        """KVDirect's tensor-centric description of the region (Chen et al. 2024, sec. 4.1, Fig. 5): base
        address, dimension names in storage order (``self.dims``), shape and strides, so a peer can compute the
        bytes of any (slot, layer, K/V, head range) itself (see :mod:`sglang.srt.mem_cache.kv_descriptor`)."""
        from sglang.srt.mem_cache.kv_descriptor import KVRegionDescriptor

        t = self.kv_data
        sc = self.scales
        return KVRegionDescriptor(
            base_address=t.data_ptr(), device=str(self.device), dtype=str(self.dtype).replace("torch.", ""),
            itemsize=t.element_size(), dims=self.dims, shape=tuple(t.shape),
            strides=tuple(t.stride()), page_size=self.page_size,
            k_scales=sc.k if sc is not None else (), v_scales=sc.v if sc is not None else ())

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id={layer_id} out of range [0, {self.layer_num})")

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K buffer of a layer, ``[size + page_size, head_num, head_dim]`` in ``dtype`` (a strided view, see the
        class doc)."""
        self._check_layer(layer_id)
        buf = self.k_buffer[layer_id]
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V buffer of a layer, ``[size + page_size, head_num, head_dim]`` in ``dtype`` (a strided view)."""
        self._check_layer(layer_id)
        buf = self.v_buffer[layer_id]
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(get_key_buffer(layer_id), get_value_buffer(layer_id))``."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of ``n`` tokens into slots ``loc``.

        Args:
            layer_id: layer index.
            loc: int64 (or int32) ``[n]`` slot indices on ``device``.
            k, v: ``[n, head_num, head_dim]`` (any float dtype; cast to the pool dtype; FP8 pools quantize with the
                layer's scales, :func:`~sglang.srt.mem_cache.kv_quant.quantize_kv`).

        Raises:
            ValueError: shapes disagree with the pool.
        """
        self._check_layer(layer_id)
        want = (loc.shape[0], self.head_num, self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"set_kv_buffer: k {tuple(k.shape)} / v {tuple(v.shape)} must both be {want}")
        k = quantize_kv(k, self.k_scale(layer_id), self.dtype)
        v = quantize_kv(v, self.v_scale(layer_id), self.dtype)
        if self.store_dtype != self.dtype:
            k = k.view(self.store_dtype)
            v = v.view(self.store_dtype)
        self.k_buffer[layer_id][loc] = k
        self.v_buffer[layer_id][loc] = v
