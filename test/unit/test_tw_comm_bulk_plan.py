"""CPU model of the copy plan of tw-comm's bulk-copy two-shot (tw-comm/csrc/allreduce_rmsnorm/twoshot_bulk.cu):
every block's push / pull segments (byte ranges between x, the peers' staging slots and out / residual), cut
into 16 KiB ring tiles, then the reduce in rank order, executed on per-rank byte buffers for worlds 2 / 4 / 8,
token counts not divisible by the world, grids from 1 to more blocks than rows and rows larger than one tile;
the result must equal the fp32 torch reference (allreduce + residual add + RMSNorm) bit for bit in bf16.
This checks the index math the kernel's bulk copies use; the GPU test (test/gpu/test_tw_comm_gpu.py::
test_tw_comm_bulk_gpu) checks the kernel itself."""

import pytest
import torch

from sgl_kernel.tw_comm.reference import add_rmsnorm_fp32, owned_range

TILE = 16 * 1024  # kBulkTile
EPS = 1e-5


def _segments(rank, world, tokens, hidden, lo, hi, planes):
    """Mirror of bulk_segs: (src buffer, src byte offset, dst buffer, dst byte offset, bytes) per peer and plane.
    Buffers: ("x", r), ("in", q) = q's staging input region, ("outreg", q), ("out", r), ("res", r)."""
    rb, stride = hidden * 2, -(-tokens // world)
    segs = []
    for d in range(1, world):
        q = (rank + d) % world
        s, e_abs = owned_range(tokens, world, q)
        e = min(hi, e_abs - s)
        if e <= lo:
            continue
        n = (e - lo) * rb
        if planes == 0:
            segs.append((("x", rank), (s + lo) * rb, ("in", q), (rank * stride + lo) * rb, n))
            continue
        segs.append((("outreg", q), lo * rb, ("out", rank), (s + lo) * rb, n))
        if planes == 2:
            segs.append((("outreg", q), (stride + lo) * rb, ("res", rank), (s + lo) * rb, n))
    return segs


def _copy_tiles(mem, segs):
    """bulk_copy: every segment in 16 KiB tiles (the last one shorter), in order."""
    for src, so, dst, do, n in segs:
        for off in range(0, n, TILE):
            b = min(TILE, n - off)
            mem[dst][do + off:do + off + b] = mem[src][so + off:so + off + b]


def _run_model(world, tokens, hidden, grid, sharded, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, hidden, generator=g).bfloat16() for _ in range(world)]
    residual = (torch.randn(tokens, hidden, generator=g) * 2).bfloat16()
    weight = (torch.rand(hidden, generator=g) + 0.5).bfloat16()
    stride, rb = -(-tokens // world), hidden * 2
    as_bytes = lambda t: t.contiguous().view(torch.uint8).reshape(-1).clone()  # noqa: E731
    mem = {}
    for r in range(world):
        mem[("x", r)] = as_bytes(xs[r])
        mem[("res", r)] = as_bytes(residual)
        mem[("out", r)] = torch.zeros(tokens * rb, dtype=torch.uint8)
        mem[("in", r)] = torch.zeros(world * stride * rb, dtype=torch.uint8)
        mem[("outreg", r)] = torch.zeros(2 * stride * rb, dtype=torch.uint8)
    blocks = [(stride * b // grid, stride * (b + 1) // grid) for b in range(grid)]
    for r in range(world):  # push, every block
        for lo, hi in blocks:
            _copy_tiles(mem, _segments(r, world, tokens, hidden, lo, hi, 0))
    for r in range(world):  # reduce own rows in rank order (own x at q == rank), residual add, RMSNorm
        s, e = owned_range(tokens, world, r)
        staged = mem[("in", r)].view(torch.bfloat16).reshape(world, stride, hidden)
        contrib = [xs[r][s:e] if q == r else staged[q, :e - s] for q in range(world)]
        acc = sum(c.float() for c in contrib)
        res_rows = mem[("res", r)].view(torch.bfloat16).reshape(tokens, hidden)[s:e]
        new_res, normed = add_rmsnorm_fp32(acc, res_rows, weight, EPS)
        mem[("res", r)].view(torch.bfloat16).reshape(tokens, hidden)[s:e] = new_res
        mem[("out", r)].view(torch.bfloat16).reshape(tokens, hidden)[s:e] = normed
        outreg = mem[("outreg", r)].view(torch.bfloat16).reshape(2, stride, hidden)
        outreg[0, :e - s] = normed
        outreg[1, :e - s] = new_res
    for r in range(world):  # pull, every block
        for lo, hi in blocks:
            _copy_tiles(mem, _segments(r, world, tokens, hidden, lo, hi, 1 if sharded else 2))
    total = sum(x.float() for x in xs)
    ref_res, ref_out = add_rmsnorm_fp32(total, residual, weight, EPS)
    return mem, ref_res.bfloat16(), ref_out.bfloat16()


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("tokens,hidden,grid", [(1, 64, 1), (13, 2048, 3), (77, 12288, 16), (130, 8, 256),
                                                (257, 1024, 24)])
@pytest.mark.parametrize("sharded", [False, True])
def test_bulk_copy_plan_reproduces_allreduce_rmsnorm(world, tokens, hidden, grid, sharded):
    grid = min(grid, -(-tokens // world))  # prepare_twoshot: grid = min(max_blocks, ceil(T / world))
    mem, ref_res, ref_out = _run_model(world, tokens, hidden, grid, sharded, seed=world * 1000 + tokens)
    for r in range(world):
        out = mem[("out", r)].view(torch.bfloat16).reshape(tokens, hidden)
        res = mem[("res", r)].view(torch.bfloat16).reshape(tokens, hidden)
        assert torch.equal(out, ref_out), f"rank {r}: out differs"
        if sharded:
            s, e = owned_range(tokens, world, r)
            assert torch.equal(res[s:e], ref_res[s:e]), f"rank {r}: own residual rows differ"
        else:
            assert torch.equal(res, ref_res), f"rank {r}: residual differs"
