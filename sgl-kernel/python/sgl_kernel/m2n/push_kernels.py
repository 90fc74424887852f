"""Device side of the device-driven M2N transport (MegaScale-Infer, Zhu et al. 2025, sec. 5: M2N without host
involvement per message; GPU-to-GPU writes + flags).

One Triton kernel, :func:`m2n_recv_kernel`, built only from the Triton-distributed primitives of
:mod:`sgl_kernel.tdist.primitives` (no second signalling layer):

1. (optional, program 0) release-store ``ack_value`` into the sender's ack word (``st.release.sys`` at
   ``ack + ack_delta``: a local address moved by the element distance to the peer's IPC-mapped heap, tdist's
   ``symm_at`` arithmetic, so no tensor ever wraps peer memory): the previous message from that sender has been
   consumed, its ring slot may be overwritten;
2. every program spins with ``ld.acquire.sys`` on the slot's flag word until it is ``>= expect``
   (``tdist.primitives.wait``: bounded by the heap's wall-clock budget; on expiry it writes the error record that
   the host decodes with ``SymmetricHeap.check``, and the kernel goes on with 0 rows, never out of bounds);
3. the flag word carries ``(sequence + 1) << 32 | rows``: the row count travels on the device, not through the host.
   ``rows`` goes to ``rows_out`` (int64 scalar) and, with ``COPY``, the payload's column blocks are copied from the
   ring slot (packed for ``rows``) to ``dst`` packed for ``cap_rows`` rows (``cap_rows < 0``: for ``rows``), i.e.
   fixed offsets a consumer can view without knowing ``rows`` on the host.

The same kernel with ``COPY=False`` and no ack is the sender's bounded wait for a free slot (its ack word).
:func:`relayout_reference` is the torch reference of step 3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.tdist import primitives as P

M2N_WAIT_SITE = 13  # tdist.layout.WAIT_SITES code of this kernel (names it in the host's error)
ROWS_MASK = 0xFFFFFFFF


@triton.jit(do_not_specialize=["expect", "ack_delta", "ack_value", "cap_rows", "max_rows"])
def m2n_recv_kernel(meta, flag, expect, ack, ack_delta, ack_value, src, dst, rows_out, col_bytes, cap_rows, max_rows,
                    NCOL: tl.constexpr, COPY: tl.constexpr, BLOCK: tl.constexpr):
    """See the module docstring. ``meta``: the transport heap's meta (int64 [4]); ``flag``/``ack``: ``*i64``;
    ``src``/``dst``: ``*i32`` (16-byte aligned, column blocks padded to 16 bytes); ``rows_out``: ``*i64`` [1];
    ``col_bytes``: ``*i64`` [NCOL] bytes per row of each column; ``max_rows``: rows are clamped to it."""
    pid = tl.program_id(0)
    if ack_value > 0:
        if pid == 0:
            P.st_release(ack + ack_delta, ack_value)
    token = P.wait(flag, expect, meta, 13)
    rows = tl.where(token >= expect, token & 0xFFFFFFFF, 0)
    rows = tl.minimum(rows, max_rows)
    if pid == 0:
        tl.store(rows_out, rows)
    if COPY:
        src = P.consume_token(src, token)
        nprog = tl.num_programs(0)
        rows_d = tl.where(cap_rows < 0, rows, cap_rows)
        soff = rows * 0
        doff = rows * 0
        for c in tl.static_range(NCOL):
            cb = tl.load(col_bytes + c)
            n4 = (rows * cb + 15) // 16 * 4  # int32 words of the padded block
            for start in range(pid * BLOCK, n4, nprog * BLOCK):
                offs = start + tl.arange(0, BLOCK)
                m = offs < n4
                v = tl.load(src + tl.multiple_of(soff, 4) + offs, mask=m)
                tl.store(dst + tl.multiple_of(doff, 4) + offs, v, mask=m)
            soff += n4
            doff += (rows_d * cb + 15) // 16 * 4


@triton.jit(do_not_specialize=["delta", "value"])
def m2n_flag_kernel(flag, delta, value):
    """The sender's flag write when the driver's stream write is unavailable: ``fence.sc.sys`` (the copy-engine
    payload copy before it on the stream is complete; order it system-wide) then ``st.release.sys`` of ``value`` at
    ``flag + delta`` (the peer's mapped flag word). Launch with grid (1,)."""
    P.quiet()
    P.st_release(flag + delta, value)


def relayout_reference(ring: torch.Tensor, rows: int, col_bytes: list[int], cap_rows: int) -> torch.Tensor:
    """Torch reference of the kernel's copy: ``ring`` (uint8, column blocks packed for ``rows`` rows, each padded to
    16 bytes) -> a new uint8 tensor with the blocks at the offsets for ``cap_rows`` rows (``cap_rows < 0``: ``rows``);
    bytes outside the copied blocks are 0."""
    cap = rows if cap_rows < 0 else cap_rows
    out = torch.zeros(sum((cap * b + 15) // 16 * 16 for b in col_bytes), dtype=torch.uint8, device=ring.device)
    so = do = 0
    for b in col_bytes:
        n = (rows * b + 15) // 16 * 16
        out[do:do + n] = ring[so:so + n]
        so += n
        do += (cap * b + 15) // 16 * 16
    return out


def launch_flag(flag: torch.Tensor, delta: int, value: int) -> None:
    """Launch :func:`m2n_flag_kernel` on the current stream (``flag``: an int64 view of this rank's heap)."""
    m2n_flag_kernel[(1,)](flag, delta, value)


def flag_value(seq: int, rows: int) -> int:
    """The flag word of message ``seq`` (0-based, per sender and receiver) with ``rows`` rows. Raises ValueError for
    rows outside [0, 2**32) or a negative seq."""
    if not 0 <= rows <= ROWS_MASK or seq < 0:
        raise ValueError(f"M2N flag: rows={rows} must be in [0, 2**32) and seq={seq} >= 0")
    return ((seq + 1) << 32) | rows


def launch_recv(meta: torch.Tensor, flag: torch.Tensor, expect: int, ack: torch.Tensor, ack_delta: int,
                ack_value: int,
                src: torch.Tensor, dst: torch.Tensor, rows_out: torch.Tensor, col_bytes: torch.Tensor,
                cap_rows: int, max_rows: int, copy: bool, grid: int, block: int = 1024) -> None:
    """Launch :func:`m2n_recv_kernel` on the current stream (``grid`` programs). ``src``/``dst`` are int32 views;
    ``flag``/``ack`` int64 views of this rank's heap slots; the ack is stored ``ack_delta`` int64 elements further
    (in the sender's mapped heap)."""
    m2n_recv_kernel[(grid,)](meta, flag, expect, ack, ack_delta, ack_value, src, dst, rows_out, col_bytes, cap_rows,
                             max_rows,
                             NCOL=int(col_bytes.numel()), COPY=copy, BLOCK=block)
