"""The Communicator contract on gloo (2 spawned ranks) vs single-process references, and backend selection."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from tp_worker import spawn_ranks  # noqa: E402
from sglang.srt.distributed.communicator import (  # noqa: E402
    COMMUNICATOR_BACKENDS,
    NOCOMM_LABEL,
    Communicator,
    NoCommCommunicator,
    SwitchCommunicator,
    TorchCommunicator,
    choose_backend,
    create_communicator,
)
from sglang.srt.layers.layernorm import rmsnorm_ref  # noqa: E402

WORLD = 2
T, H = 6, 16


def _inputs(rank: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    w = 1.0 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(seed))  # replicated weight
    return {"x": torch.randn(T, H, generator=g), "res": torch.randn(T, H, generator=g), "w": w}


def _rank_ops(ps, seed: int) -> dict[str, torch.Tensor]:
    from sglang.srt.distributed.communicator import create_communicator

    from sglang.srt.distributed.parallel_state import all_reduce_min_int, broadcast_bytes_list

    comm = create_communicator(ps, "auto")
    d = _inputs(ps.tp_rank, seed)
    sent = _messages(seed) if ps.tp_rank == 0 else None
    got_msgs = [broadcast_bytes_list(sent, ps.cpu_group), broadcast_bytes_list([] if ps.tp_rank == 0 else None,
                                                                               ps.cpu_group)]
    out, res = comm.all_reduce_add_rmsnorm(d["x"].clone(), d["res"].clone(), d["w"], 1e-6)
    return {
        "describe": comm.describe(),
        "all_reduce": comm.all_reduce(d["x"].clone()),
        "all_reduce_bf16": comm.all_reduce(d["x"].to(torch.bfloat16)),
        "gather_last": comm.all_gather(d["x"], dim=-1),
        "gather_first": comm.all_gather(d["x"], dim=0),
        "reduce_scatter": comm.reduce_scatter(d["x"].clone()),
        "norm_out": out, "norm_res": res, "msgs": got_msgs,
        "min": all_reduce_min_int(1000 + 7 * (seed % 5) - ps.tp_rank * 3, ps.cpu_group),
    }


def _messages(seed: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 300, (5,), generator=g).tolist()
    return [bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).tolist()) for n in sizes]


@pytest.fixture(scope="module")
def gloo_results():
    seed = int.from_bytes(os.urandom(2), "little")
    return seed, spawn_ranks(_rank_ops, WORLD, seed)


def test_contract_on_gloo(gloo_results):
    seed, results = gloo_results
    ins = [_inputs(r, seed) for r in range(WORLD)]
    total = sum(d["x"] for d in ins)
    for rank, got in enumerate(results):
        assert "TorchCommunicator(backend=gloo" in got["describe"]
        torch.testing.assert_close(got["all_reduce"], total, atol=1e-6, rtol=1e-6)
        assert got["all_reduce_bf16"].dtype == torch.bfloat16
        torch.testing.assert_close(got["all_reduce_bf16"].float(), total, atol=0.05, rtol=0.02)
        torch.testing.assert_close(got["gather_last"], torch.cat([d["x"] for d in ins], dim=-1))
        torch.testing.assert_close(got["gather_first"], torch.cat([d["x"] for d in ins], dim=0))
        n = T // WORLD
        torch.testing.assert_close(got["reduce_scatter"], total[rank * n:(rank + 1) * n], atol=1e-6, rtol=1e-6)
        ref_out, ref_res = rmsnorm_ref(total, ins[rank]["w"], 1e-6, ins[rank]["res"])
        torch.testing.assert_close(got["norm_res"], ins[rank]["res"] + total, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got["norm_out"], ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["norm_res"], ref_res, atol=1e-6, rtol=1e-6)
        assert got["msgs"] == [_messages(seed), []]
        assert got["min"] == 1000 + 7 * (seed % 5) - (WORLD - 1) * 3


def test_world_one_is_identity():
    comm = create_communicator(None, "auto")
    assert isinstance(comm, TorchCommunicator) and comm.world_size == 1
    x = torch.randn(3, 5)
    assert torch.equal(comm.all_reduce(x.clone()), x)
    assert torch.equal(comm.all_gather(x, dim=-1), x)
    assert torch.equal(comm.reduce_scatter(x.clone()), x)
    r, w = torch.randn(3, 5), torch.rand(5) + 0.5
    out, res = comm.all_reduce_add_rmsnorm(x.clone(), r.clone(), w, 1e-5)
    ref = rmsnorm_ref(x, w, 1e-5, r)
    assert torch.equal(out, ref[0]) and torch.equal(res, ref[1])


def test_nocomm_skips_collectives_and_warns(caplog):
    with caplog.at_level(logging.WARNING):
        comm = NoCommCommunicator(1, 4)
    assert NOCOMM_LABEL in caplog.text and NOCOMM_LABEL in comm.describe()
    x = torch.randn(8, 3)
    assert torch.equal(comm.all_reduce(x), x)
    g = comm.all_gather(x, dim=-1)
    assert g.shape == (8, 12) and torch.equal(g[:, 3:6], x)
    assert torch.equal(comm.reduce_scatter(x), x[2:4])
    r, w = torch.randn(8, 3), torch.rand(3) + 0.5
    out, _ = comm.all_reduce_add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(out, rmsnorm_ref(x, w, 1e-6, r)[0])
    with pytest.raises(ValueError, match="divisible by world_size=4"):
        comm.reduce_scatter(torch.randn(6, 2))


def test_switch_communicator_delegates():
    real, fake = TorchCommunicator(None, 0, 1), NoCommCommunicator(0, 1)
    sw = SwitchCommunicator(real, fake)
    x = torch.randn(4, 2)
    assert torch.equal(sw.all_reduce(x), x)
    sw.use_real = False
    assert sw._c() is fake


def test_choose_backend_rules():
    assert choose_backend("auto", "cuda", 8, False)[0] == "custom"
    assert choose_backend("auto", "cuda", 8, True) == ("torch", "--disable-custom-all-reduce")
    assert choose_backend("auto", "cpu", 2, False)[0] == "torch"
    assert choose_backend("auto", "cuda", 16, False)[0] == "torch"
    assert choose_backend("auto", "cuda", 1, False)[0] == "torch"
    assert choose_backend("custom", "cuda", 4, True)[0] == "torch"
    assert choose_backend("nocomm", "cpu", 2, False)[0] == "nocomm"
    assert set(COMMUNICATOR_BACKENDS) >= {"torch", "custom", "nocomm"}
    with pytest.raises(ValueError, match="'bogus' is unknown"):
        choose_backend("bogus", "cpu", 2, False)


def _plugin_factory(ps):
    return NoCommCommunicator(0, 1)


def test_plugin_by_module_path_and_bad_factory(caplog):
    with caplog.at_level(logging.INFO):
        comm = create_communicator(None, f"{__name__}:_plugin_factory")
    assert isinstance(comm, NoCommCommunicator)
    assert "TP communicator" in caplog.text and "requested explicitly" in caplog.text
    with pytest.raises(ValueError, match="cannot be imported"):
        create_communicator(None, "no_such_module_xyz:factory")
    with pytest.raises(ValueError, match="not a Communicator"):
        create_communicator(None, "builtins:str")


def test_abstract_contract():
    with pytest.raises(TypeError):
        Communicator(0, 1)  # abstract
    with pytest.raises(ValueError, match="rank=2"):
        TorchCommunicator(None, 2, 2)
