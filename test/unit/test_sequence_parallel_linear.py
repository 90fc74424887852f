"""Sequence-parallel layer options on CPU (gloo, 2 and 3 ranks, uneven token splits): ColumnParallelLinear /
MergedColumnParallelLinear ``forward_gathered`` and RowParallelLinear ``forward_scattered`` with the torch
sequence-parallel ops equal the unsharded ``F.linear`` on fresh random inputs; the factory logs its choice and falls
back to torch where the fused Triton-distributed path cannot run (CPU)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from sglang.srt.distributed.sequence_parallel import (TorchSequenceParallelOps, create_sequence_parallel_ops,
                                                      split_rows)


def _port():
    from sglang.srt.utils.common import free_tcp_ports  # below the ephemeral range (parallel test workers)

    return free_tcp_ports(1)[0]


def _worker(rank, world, port, total, q):
    import torch.distributed as dist

    from sglang.srt.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        ops = TorchSequenceParallelOps(dist.group.WORLD, rank, world)
        g = torch.Generator().manual_seed(5)
        h, inter = 24, 36
        x = torch.randn(total, h, generator=g)
        w1 = torch.randn(inter, h, generator=g)
        b1 = torch.randn(inter, generator=g)
        w2 = torch.randn(h, inter, generator=g)
        b2 = torch.randn(h, generator=g)
        rows = split_rows(total, world)
        start = sum(rows[:rank])
        col = ColumnParallelLinear(h, inter, bias=True, tp_rank=rank, tp_size=world)
        col.weight_loader(col.weight, w1)
        col.weight_loader(col.bias, b1)
        row = RowParallelLinear(inter, h, bias=True, tp_rank=rank, tp_size=world)
        row.weight_loader(row.weight, w2)
        row.weight_loader(row.bias, b2)
        mid = col.forward_gathered(x[start: start + rows[rank]], rows, ops)  # [T, inter/world]
        out = row.forward_scattered(mid, rows, ops)  # [rows[rank], h]
        ref = F.linear(F.linear(x, w1, b1), w2, b2)[start: start + rows[rank]]
        err = (out - ref).abs().max().item() if out.numel() else 0.0
        merged = MergedColumnParallelLinear(h, [inter, inter], tp_rank=rank, tp_size=world)
        merged.weight_loader(merged.weight, w1, 0)
        merged.weight_loader(merged.weight, w1 * 2, 1)
        m = merged.forward_gathered(x[start: start + rows[rank]], rows, ops)
        n = inter // world
        merr = (m - torch.cat([F.linear(x, w1[rank * n:(rank + 1) * n]),
                               F.linear(x, 2 * w1[rank * n:(rank + 1) * n])], dim=1)).abs().max().item()
        bad = None
        try:
            row.forward_gathered(mid, rows, ops)
        except ValueError:
            bad = "ok"
        q.put((rank, tuple(out.shape), err, merr, bad))
        dist.destroy_process_group()
    except Exception as e:  # reported to the parent
        q.put((rank, None, repr(e), None, None))


@pytest.mark.parametrize("world,total", [(2, 7), (3, 2)])
def test_gathered_and_scattered_linears_match_unsharded(world, total):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, total, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    rows = split_rows(total, world)
    for rank, shape, err, merr, bad in res:
        assert shape == (rows[rank], 24), (rank, shape, err)
        assert err < 1e-4 and merr < 1e-4, (rank, err, merr)
        assert bad == "ok"


def test_torch_ops_validate_rows():
    ops = TorchSequenceParallelOps(None, 0, 1)
    w = torch.randn(5, 4)
    with pytest.raises(ValueError, match="rows"):
        ops.ag_linear(torch.randn(3, 4), w, None, [2])
    with pytest.raises(ValueError, match="rows"):
        ops.linear_rs(torch.randn(3, 4), w, None, [3, 0])
    x = torch.randn(3, 4)
    assert torch.allclose(ops.ag_linear(x, w, None, [3]), F.linear(x, w))
    assert torch.allclose(ops.linear_rs(x, w, None, [3]), F.linear(x, w))
    with pytest.raises(ValueError):
        split_rows(-1, 2)


def test_factory_logs_and_falls_back_on_cpu(caplog):
    class PS:
        device, tp_size, tp_rank, device_group, cpu_group = "cpu", 2, 0, None, None

    with caplog.at_level(logging.INFO, logger="sglang.srt.distributed.sequence_parallel"):
        ops = create_sequence_parallel_ops(PS(), enable_tdist_overlap=True)
    assert isinstance(ops, TorchSequenceParallelOps) and ops.world_size == 2
    assert "tdist overlap requested but not used" in caplog.text and "torch collectives" in caplog.text
    assert create_sequence_parallel_ops(None).world_size == 1
