"""Expert parallelism by all-to-all, the parts that need no process group: ``--moe-a2a-backend`` in ServerArgs and
in the deployment plan (every worker gets the spec; bad combinations refused before any process starts, naming both
flags), the dispatcher's input checks (raised before any collective), the token scopes and the mode choice."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.deployment.compose import plan_deployment
from sglang.srt.deployment.render import render_plan
from sglang.srt.server_args import ServerArgs, prepare_launch_args


def _args(**kw) -> ServerArgs:
    return ServerArgs(device="cpu", **kw)


def test_plan_gives_every_worker_the_a2a_spec_and_notes_it():
    plan = plan_deployment(_args(tp_size=4, ep_size=4, moe_a2a_backend="nccl"))
    assert "moe_a2a" in plan.techniques
    assert {(w.moe_a2a.backend, w.moe_a2a.token_scope, w.moe_a2a.max_inflight) for w in plan.workers} == \
        {("nccl", "tp_slice", 2)}
    assert any("moe a2a: nccl all-to-all over EP 4" in n for n in plan.notes)
    assert "moe a2a: nccl" in render_plan(plan)
    assert all(w.moe_a2a is None for w in plan_deployment(_args(tp_size=2, ep_size=2)).workers)


@pytest.mark.parametrize("kw,other", [
    (dict(enable_afd=True), "--enable-afd"),
    (dict(enable_tokenweave=True), "--enable-tokenweave"),
    (dict(enable_tdist_overlap=True), "--enable-tdist-overlap"),
])
def test_incompatible_techniques_are_refused_naming_both_flags(kw, other):
    with pytest.raises(ValueError) as e:
        plan_deployment(_args(tp_size=2, ep_size=2, moe_a2a_backend="nccl", **kw))
    assert "--moe-a2a-backend nccl" in str(e.value) and other in str(e.value)


def test_tdist_needs_the_interpreter_on_cpu_and_one_node(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("triton") is None:  # not imported: the interpreter tests need a fresh import
        pytest.skip("triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 .* or use --moe-a2a-backend nccl"):
        plan_deployment(_args(tp_size=2, ep_size=2, moe_a2a_backend="tdist"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert plan_deployment(_args(tp_size=2, ep_size=2, moe_a2a_backend="tdist")).workers[0].moe_a2a.backend == "tdist"
    with pytest.raises(ValueError, match="--nnodes=2 cannot be combined"):
        plan_deployment(_args(tp_size=2, ep_size=2, moe_a2a_backend="tdist", nnodes=2, dist_init_addr="h:1"))


@pytest.mark.parametrize("kw,want", [
    (dict(tp_size=2, ep_size=2, moe_a2a_backend="deepep"), "DeepEP is not part of this server; use nccl"),
    (dict(moe_a2a_backend="nccl"), "needs --ep-size > 1; add --ep-size 2"),
    (dict(tp_size=4, ep_size=2, moe_a2a_backend="tdist"), "set --ep-size equal to --tp-size (4)"),
    (dict(tp_size=2, ep_size=2, moe_a2a_backend="alltoall"), "use none, nccl or tdist"),
])
def test_bad_flag_values(kw, want):
    with pytest.raises(ValueError) as e:
        _args(**kw)
    assert want in str(e.value) and "--moe-a2a-backend=" in str(e.value)


def test_cli_flag_and_help():
    args, _ = prepare_launch_args(["--tp", "2", "--ep-size", "2", "--moe-a2a-backend", "nccl"])
    assert args.moe_a2a_backend == "nccl"
    assert prepare_launch_args([])[0].moe_a2a_backend == "none"
    from sglang.srt.server_args_help import SERVER_ARGS_HELP

    assert "none (default" in SERVER_ARGS_HELP["moe_a2a_backend"]


def _cfg(**kw):
    from sglang.srt.layers.moe.token_dispatcher import DispatcherConfig

    base = dict(num_experts=8, top_k=2, hidden_size=16, ep_size=2, ep_rank=1, max_tokens_normal=32,
                max_tokens_low_latency=4, dtype=torch.float32)
    return DispatcherConfig(**{**base, **kw})


def test_dispatcher_config_sizes_and_errors():
    c = _cfg()
    assert (c.num_local_experts, c.expert_start, c.slots_per_rank, c.pair_capacity, c.recv_capacity) == (4, 4, 2, 8, 16)
    assert _cfg(top_k=6).slots_per_rank == 4  # at most E/ep distinct experts per rank
    for bad in (dict(num_experts=7), dict(ep_rank=2), dict(top_k=9), dict(max_tokens_low_latency=0),
                dict(dtype=torch.int8)):
        with pytest.raises(ValueError):
            _cfg(**bad)


def test_dispatch_input_errors_come_before_any_collective():
    from sglang.srt.layers.moe.token_dispatcher import DispatchMode
    from sglang.srt.layers.moe.token_dispatcher.nccl import NcclTokenDispatcher

    d = NcclTokenDispatcher(_cfg(), None)  # no group: any collective would fail differently
    x, ids, w = torch.zeros(5, 16), torch.zeros(5, 2, dtype=torch.int64), torch.full((5, 2), 0.5)
    with pytest.raises(ValueError, match="5 tokens exceed the low_latency capacity 4"):
        d.dispatch(x, ids, w, DispatchMode.LOW_LATENCY)
    with pytest.raises(ValueError, match="x must be"):
        d.dispatch(x.double(), ids, w, "normal")
    with pytest.raises(ValueError, match="topk_ids"):
        d.dispatch(x, ids[:, :1], w, "normal")
    with pytest.raises(ValueError, match="fp32"):
        d.dispatch(x, ids, w.double(), "normal")
    assert d.calls == {"normal": 0, "low_latency": 0}
    assert NcclTokenDispatcher.buffer_bytes(_cfg()) == 2 * 16 * 2 * (20 + 16) * 4  # sets x rows x 2 x (W + H) x 4 B


def test_row_format_and_routing_bookkeeping():
    from sglang.srt.layers.moe.token_dispatcher.routing import group_received, pack_rows, plan_send, row_width, \
        trailer, weighted_sum

    assert row_width(16, torch.float32) == 20 and row_width(7168, torch.bfloat16) == 7176
    assert row_width(63, torch.bfloat16) * 2 % 16 == 0
    ids = torch.tensor([[5, 0], [1, 7], [6, 4]])  # E_loc 4: rank 0 gets 0, 1; rank 1 gets 5, 7, 6, 4
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    plan = plan_send(ids, 4, 2, pair_capacity=6)
    assert plan.send_counts.tolist() == [2, 4] and plan.dest.tolist() == [0, 0, 1, 1, 1, 1]
    assert plan.order.tolist() == [1, 2, 0, 3, 4, 5] and plan.slot.tolist() == [0, 1, 6, 7, 8, 9]
    x = torch.arange(3, dtype=torch.float32).view(3, 1).repeat(1, 16)
    rows = torch.zeros(6, row_width(16, torch.float32))
    pack_rows(rows, x, w, plan, 2)
    lid, lw = trailer(rows)
    assert lid.tolist() == [0, 1, 1, 3, 2, 0] and torch.allclose(lw, torch.tensor([0.4, 0.7, 0.6, 0.3, 0.5, 0.5]))
    g = group_received(rows[2:], 16, 4)  # what rank 1 receives
    assert g.expert_ids.tolist() == [0, 1, 2, 3] and g.counts.tolist() == [1, 1, 1, 1]
    assert g.x[:, 0].tolist() == [2.0, 0.0, 2.0, 1.0]  # tokens of local experts 0 (id 4), 1 (5), 2 (6), 3 (7)
    y = torch.ones(6, 16)
    out = weighted_sum(y, plan, w, 3, 2, torch.float32, weights_applied=False)
    assert torch.allclose(out, torch.ones(3, 16))  # weights sum to 1 per token


def test_token_scopes_and_mode_choice():
    from sglang.srt.forward_batch_info import ForwardMode
    from sglang.srt.layers.moe.ep_a2a import EpA2aMoe, LocalTokensScope, TpSliceScope, make_token_scope
    from sglang.srt.layers.moe.token_dispatcher import DispatchMode
    from sglang.srt.layers.stages import LayerState, moe_dispatch_mode

    ranges = [TpSliceScope(r, 3).local_range(7) for r in range(3)]
    assert ranges == [(0, 2), (2, 4), (4, 7)] and TpSliceScope(0, 3).max_local(7) == 3
    assert [TpSliceScope(r, 4).local_range(2) for r in range(4)] == [(0, 0), (0, 1), (1, 1), (1, 2)]
    out = TpSliceScope(1, 3).assemble(torch.ones(2, 4), 7)
    assert out[2:4].eq(1).all() and out[:2].eq(0).all() and out[4:].eq(0).all()
    assert make_token_scope("local", 0, 2).local_range(5) == (0, 5)
    with pytest.raises(ValueError):
        make_token_scope("replicated", 0, 2)
    assert moe_dispatch_mode(SimpleNamespace(forward_mode=ForwardMode.DECODE)) == "low_latency"
    assert moe_dispatch_mode(SimpleNamespace(forward_mode=ForwardMode.MIXED)) == "normal"
    assert moe_dispatch_mode(None) == "normal"
    assert moe_dispatch_mode(SimpleNamespace(forward_mode=ForwardMode.DECODE, moe_dispatch_mode="normal")) == "normal"
    st = LayerState(torch.zeros(1, 4), None, torch.zeros(1), SimpleNamespace(forward_mode=ForwardMode.DECODE))
    assert st.moe.dispatch_mode == "low_latency"
    disp = SimpleNamespace(config=SimpleNamespace(max_tokens_low_latency=4))
    tp = EpA2aMoe(disp, TpSliceScope(0, 2))
    assert tp.resolve_mode("low_latency", 8) is DispatchMode.LOW_LATENCY
    assert tp.resolve_mode("low_latency", 9) is DispatchMode.NORMAL  # ceil(9/2) > 4 on every rank alike
    assert tp.resolve_mode(None, 1) is DispatchMode.NORMAL
    with pytest.raises(ValueError, match="caller must choose normal mode on every rank"):
        EpA2aMoe(disp, LocalTokensScope()).resolve_mode("low_latency", 5)
