"""Tensor-centric metadata of a KV region (KVDirect, Chen et al. 2024, sec. 4.1, Fig. 5).

A worker publishes, per KV region, its base address, dimension names, shape and strides. A peer then
turns "page p of layer l, K or V, heads [h0, h1)" into byte ranges by index x stride arithmetic, with
no round trip per block. This module is pure Python (no torch), so transfer engines and routers can use
it without the model stack.

Our pools use dims ``("layer", "kv", "slot", "head", "head_dim")`` (layer-major) or ``("slot", "layer", "kv",
"head", "head_dim")`` (token-major; see :class:`~sglang.srt.mem_cache.memory_pool.MHATokenToKVPool` and
``--kv-cache-layout``); consumers address by dim name, never by position. Pages are ``page_size`` consecutive
slots, page 0 being the reserved dummy page.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

REQUIRED_DIMS = ("layer", "kv", "slot", "head", "head_dim")


@dataclass(frozen=True)
class KVRegionDescriptor:
    """One contiguous KV region.

    Attributes:
        base_address: address of the element at index 0 of every dim (host or device pointer, bytes).
        device: "cpu" or "cuda:N" (where the address is valid).
        dtype: the KV cache's dtype name ("bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", ...; FP8 caches
            are stored as bytes and named by their FP8 format, so E4M3 and E5M2 regions never look alike).
        itemsize: bytes per element (what every byte range is computed with: 1 for FP8).
        dims: dimension names, outermost first (must contain :data:`REQUIRED_DIMS`).
        shape: size per dim; strides: elements per step along each dim.
        page_size: slots per page (the unit blocks are addressed in).
        head_offset: global KV-head index of this region's head 0 (tensor parallelism shards KV heads:
            TP rank r of a model with ``total_heads`` KV heads holds heads ``[head_offset, head_offset +
            shape[head])``). Default 0.
        total_heads: KV heads of the whole model (0: this region holds them all). Lets a peer with another
            TP size pick exactly the heads it owns (KVDirect sec. 4.1 with heterogeneous TP).
        k_scales, v_scales: per-layer FP32 scales of an FP8 cache (stored value x scale = K or V), one per layer of
            the ``layer`` dim; empty for unscaled dtypes. Both sides of a transfer must agree on them: bytes move
            without conversion (:func:`check_same_format`).
    Raises (``__post_init__``): ValueError on inconsistent dims/shape/strides, non-positive sizes, or scales whose
        count is not the layer count.
    """

    base_address: int
    device: str
    dtype: str
    itemsize: int
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    page_size: int
    head_offset: int = 0
    total_heads: int = 0
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not (len(self.dims) == len(self.shape) == len(self.strides)):
            raise ValueError(f"KVRegionDescriptor: dims {self.dims}, shape {self.shape} and strides {self.strides} "
                             "must have the same length")
        missing = [d for d in REQUIRED_DIMS if d not in self.dims]
        if missing:
            raise ValueError(f"KVRegionDescriptor: dims {self.dims} lack {missing}")
        if self.itemsize <= 0 or self.page_size <= 0 or min(self.shape) <= 0:
            raise ValueError(f"KVRegionDescriptor: itemsize={self.itemsize}, page_size={self.page_size} and "
                             f"shape={self.shape} must be positive")
        if self.head_offset < 0 or self.total_heads < 0 or (
                self.total_heads and self.head_offset + self.size("head") > self.total_heads):
            raise ValueError(f"KVRegionDescriptor: heads [{self.head_offset}, +{self.size('head')}) do not fit "
                             f"total_heads={self.total_heads}")
        if len(self.k_scales) != len(self.v_scales) or self.k_scales and len(self.k_scales) != self.size("layer"):
            raise ValueError(f"KVRegionDescriptor: {len(self.k_scales)} K and {len(self.v_scales)} V scales for "
                             f"{self.size('layer')} layers")

    @property
    def global_heads(self) -> tuple[int, int]:
        """Global KV-head range ``[lo, hi)`` this region holds."""
        return self.head_offset, self.head_offset + self.size("head")

    @property
    def model_heads(self) -> int:
        """KV heads of the whole model (``total_heads``, or the local count when 0)."""
        return self.total_heads or self.size("head")

    # ---- sizes ---------------------------------------------------------------------------------------
    def size(self, dim: str) -> int:
        """Extent of dimension ``dim`` (ValueError for an unknown name)."""
        return self.shape[self._axis(dim)]

    def stride_bytes(self, dim: str) -> int:
        """Bytes between consecutive indices of ``dim``."""
        return self.strides[self._axis(dim)] * self.itemsize

    @property
    def num_pages(self) -> int:
        """Pages in the region, the dummy page 0 included."""
        return self.size("slot") // self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes spanned from the base address to the last element (inclusive)."""
        return (sum((n - 1) * s for n, s in zip(self.shape, self.strides)) + 1) * self.itemsize

    def _axis(self, dim: str) -> int:
        try:
            return self.dims.index(dim)
        except ValueError:
            raise ValueError(f"unknown KV dimension {dim!r}; dims are {self.dims}") from None

    # ---- address arithmetic --------------------------------------------------------------------------
    def element_address(self, **index: int) -> int:
        """Address of one element; ``index`` names every dim (e.g. ``layer=3, kv=1, slot=17, head=2, head_dim=0``).

        Raises:
            ValueError: a missing/unknown dim or an index out of range.
        """
        if set(index) != set(self.dims):
            raise ValueError(f"element_address needs exactly the dims {self.dims}, got {sorted(index)}")
        off = 0
        for d, n, s in zip(self.dims, self.shape, self.strides):
            i = index[d]
            if not 0 <= i < n:
                raise ValueError(f"index {d}={i} outside [0, {n})")
            off += i * s
        return self.base_address + off * self.itemsize

    def block_ranges(self, page: int, layer: int, kv: int, head_lo: int = 0, head_hi: int = -1
                     ) -> list[tuple[int, int]]:
        """Byte ranges ``[(address, nbytes), ...]`` holding page ``page`` of ``layer``, K (``kv=0``) or V (1),
        heads ``[head_lo, head_hi)`` (``head_hi=-1``: all heads), in slot order.

        A page of all heads in the layer-major layout is one range; in the token-major layout, or for a head
        sub-range, one range per slot (a strided read), merged where the layout makes them adjacent (a token-major
        run of slots is one range across all layers only when read as a whole: see
        :func:`~sglang.srt.disaggregation.slot_plan.plan_slot_copies`).
        Raises:
            ValueError: an index or head range out of bounds.
        """
        heads = self.size("head")
        head_hi = heads if head_hi == -1 else head_hi
        if not 0 <= head_lo < head_hi <= heads:
            raise ValueError(f"head range [{head_lo}, {head_hi}) outside [0, {heads})")
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} outside [0, {self.num_pages})")
        run = (head_hi - head_lo) * self.stride_bytes("head")
        if self.stride_bytes("head_dim") != self.itemsize or self.stride_bytes("head") != \
                self.size("head_dim") * self.itemsize:
            raise ValueError("block_ranges needs (head, head_dim) to be dense; read per element instead")
        out: list[tuple[int, int]] = []
        first = page * self.page_size
        for slot in range(first, first + self.page_size):
            addr = self.element_address(layer=layer, kv=kv, slot=slot, head=head_lo, head_dim=0,
                                        **{d: 0 for d in self.dims if d not in REQUIRED_DIMS})
            if out and out[-1][0] + out[-1][1] == addr:
                out[-1] = (out[-1][0], out[-1][1] + run)
            else:
                out.append((addr, run))
        return out

    # ---- wire form -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, ints, strs) for msgpack/JSON."""
        d = asdict(self)
        d["dims"], d["shape"], d["strides"] = list(self.dims), list(self.shape), list(self.strides)
        d["k_scales"], d["v_scales"] = list(self.k_scales), list(self.v_scales)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVRegionDescriptor":
        """Inverse of :meth:`to_dict` (ValueError on a malformed dict)."""
        try:
            return cls(base_address=int(d["base_address"]), device=str(d["device"]), dtype=str(d["dtype"]),
                       itemsize=int(d["itemsize"]), dims=tuple(d["dims"]), shape=tuple(int(x) for x in d["shape"]),
                       strides=tuple(int(x) for x in d["strides"]), page_size=int(d["page_size"]),
                       head_offset=int(d.get("head_offset", 0)), total_heads=int(d.get("total_heads", 0)),
                       k_scales=tuple(float(x) for x in d.get("k_scales", ())),
                       v_scales=tuple(float(x) for x in d.get("v_scales", ())))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed KV region descriptor: {e}") from e

    def format_summary(self) -> str:
        """The KV format in words (dtype, element bytes, FP8 scales), for error messages."""
        if not self.k_scales:
            return f"{self.dtype} ({self.itemsize} B/element)"
        vals = self.k_scales + self.v_scales
        unit = "all 1.0" if all(x == 1.0 for x in vals) else f"{min(vals):.6g}..{max(vals):.6g}"
        return f"{self.dtype} ({self.itemsize} B/element, per-layer K/V scales {unit})"


def check_same_format(remote: KVRegionDescriptor, local: KVRegionDescriptor, remote_name: str = "prefill",
                      local_name: str = "decode") -> None:
    """Refuse a transfer between KV regions whose bytes mean different things: another dtype or element size, or
    FP8 scales that differ in any layer (relative 1e-6: the scales are FP32 values sent as JSON numbers). KV bytes
    move without conversion, so the two servers must run the same ``--kv-cache-dtype`` with the same checkpoint
    scales.

    Raises:
        ValueError: naming both formats (and the first layer whose scales differ) and the fix.
    """
    fix = "start both servers with the same --kv-cache-dtype (and the same checkpoint)"
    if remote.dtype != local.dtype or remote.itemsize != local.itemsize or \
            bool(remote.k_scales) != bool(local.k_scales):
        raise ValueError(f"KV cache formats differ: {remote_name} stores {remote.format_summary()}, {local_name} "
                         f"{local.format_summary()}; {fix}")
    for name, a, b in (("K", remote.k_scales, local.k_scales), ("V", remote.v_scales, local.v_scales)):
        if len(a) != len(b):
            raise ValueError(f"KV cache formats differ: {remote_name} has {len(a)} {name} scales, {local_name} "
                             f"{len(b)}; {fix}")
        for layer, (x, y) in enumerate(zip(a, b)):
            if abs(x - y) > 1e-6 * max(abs(x), abs(y)):
                raise ValueError(f"KV cache formats differ: layer {layer} {name} scale is {x!r} on the {remote_name} "
                                 f"side and {y!r} on the {local_name} side; {fix}")


def check_peer_ranks(local: KVRegionDescriptor, peer_ranks: list, local_name: str, peer_name: str) -> None:
    """:func:`check_same_format` of ``local`` against the ``"kv"`` descriptor dict of every peer rank info (the
    bootstrap route's or a RoomRequest's rank list), before any transfer is planned.

    Raises:
        ValueError: a peer rank's KV format differs (the message names both formats and the fix), or a rank info
            without a well-formed ``"kv"`` descriptor.
    """
    for info in peer_ranks:
        try:
            peer = KVRegionDescriptor.from_dict(info["kv"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"{peer_name} rank info without a KV region descriptor: {e}") from e
        check_same_format(peer, local, peer_name, local_name)
