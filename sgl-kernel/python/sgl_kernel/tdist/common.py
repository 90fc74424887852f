"""Pieces shared by the tdist kernels: the buffer-release kernel, the row-copy loop, and argument checks."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from sgl_kernel.tdist import primitives as P
from sgl_kernel.tdist.checks import DTYPES, check_rows, check_tensor  # noqa: F401  (re-exported)


@triton.jit(do_not_specialize=["inc"])
def release_kernel(meta, ready, state, inc):
    """End of a call. ``state`` (int64 [2], this rank's SymmetricHeap.counters of the op: [0] calls completed,
    [1] cumulative arrival target) holds the epochs on the device, so no launch argument changes from call to call
    (no host work per call; CUDA-graph capturable). The call's epoch is ``state[0] + 1``: tell every peer that this
    rank is done reading the buffers they write into for it: SET (release, .sys) slot ``ready[me]`` on every rank to
    the epoch; a writer of the next call waits for ``ready[dest] >= epoch`` in its own heap before touching
    ``dest``'s buffer, so buffers are reused without a host barrier. Then ``state[0] += 1`` and ``state[1] += inc``
    (the arrivals one call adds); every kernel of the next call is stream-ordered after this one.
    Launch with grid (1,) on the stream after the kernels that read the buffers."""
    me = P.rank(meta)
    world = P.num_ranks(meta)
    epoch = tl.load(state) + 1
    total = tl.load(state + 1) + inc
    for p in range(0, world):
        P.notify(ready + me, p, meta, epoch, P.SIGNAL_SET)
    tl.debug_barrier()
    tl.store(state, epoch)
    tl.store(state + 1, total)


@triton.jit
def wait_reset_kernel(meta, slot):
    """Bounded stream wait of the decomposition (decomp._Handshake with bounded_waits): spin until the int64
    signal ``slot`` (this rank's heap) is >= 1 (ld.acquire.sys, under the heap's wait budget; a timeout records the
    error, aborts the group and returns), then set it to 0. Launch with grid (1,), num_warps=1, on the stream whose
    later copies / GEMMs depend on the signal."""
    P.wait(slot, 1, meta, 12)
    tl.debug_barrier()
    tl.store(slot, 0)


@triton.jit
def ring_tile_segment(pid_m, tiles, me, world, first):
    """Which row segment an m tile belongs to when tiles go round the ring starting at segment ``me + first``
    (AG-GEMM: first=0, own data first; GEMM-RS: first=1, own segment last; Triton-distributed sec. 3.7 swizzle).
    ``tiles`` [world] int32: m tiles per segment. Returns (segment, tile index within it)."""
    seg = me
    lt = 0
    acc_t = 0
    for j in range(0, world):
        s = (me + first + j) % world
        nt = tl.load(tiles + s)
        hit = (pid_m >= acc_t) & (pid_m < acc_t + nt)
        seg = tl.where(hit, s, seg)
        lt = tl.where(hit, pid_m - acc_t, lt)
        acc_t += nt
    return seg, lt


@triton.jit
def copy_span(dst, src, n, BLOCK: tl.constexpr):
    """Copy ``n`` elements ``src[0:n] -> dst[0:n]`` with the whole CTA (weak loads/stores)."""
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def cached_i32(cache: dict, values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Device int32 tensor of ``values``, uploaded once per distinct tuple and kept in ``cache`` (the op's own dict),
    so a call with a shape seen before does no host-to-device copy (no host sync, CUDA-graph capturable). Upload a
    new shape outside graph capture (warm up every shape first)."""
    key = (tuple(int(v) for v in values), str(device))
    t = cache.get(key)
    if t is None:
        t = torch.tensor(key[0], dtype=torch.int32, device=device)
        cache[key] = t
    return t


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)
