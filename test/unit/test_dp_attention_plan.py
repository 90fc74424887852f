"""DP attention's flags, plan, router and step agreement without any model: ``--enable-dp-attention`` refuses every
combination it does not build before a process starts (naming the fix), plans one scheduler per DP rank on one
rendezvous, the front end's router spreads requests by queue length, and the per-step decision (forward / idle /
padded graph batch) is the same on every rank."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sglang.srt.deployment import plan_deployment, render_plan
from sglang.srt.dp_attention.moe import DpForwardPadding, pack_rows, unpack_rows
from sglang.srt.dp_attention.step_sync import NO_GRAPH, DpRankReport, DpStepSync, decide
from sglang.srt.managers.dp_router import DpRouter
from sglang.srt.server_args import PortArgs, ServerArgs

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))
from conftest import shared_path  # noqa: E402


def _args(**kw):
    return ServerArgs(device="cpu", **kw)


# ---- flags ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, needle", [
    (dict(tp_size=4, dp_size=2, enable_dp_attention=True), "--dp-size=2 is invalid: --enable-dp-attention needs "
     "--dp-size equal to --tp-size (--tp-size=4): use --dp-size 4 --tp-size 4"),
    (dict(tp_size=2, dp_size=4, enable_dp_attention=True), "use --dp-size 2 --tp-size 2"),
    (dict(enable_dp_attention=True), "DP attention needs --dp-size >= 2"),
    (dict(tp_size=2, dp_size=2), "--dp-size > 1 needs --enable-dp-attention"),
    (dict(dp_size=0), "--dp-size=0 is invalid"),
    (dict(load_balance_method="minimum_tokens"), "use round_robin or shortest_queue"),
])
def test_bad_dp_flags_fail_at_construction_naming_the_fix(kw, needle):
    with pytest.raises(ValueError) as e:
        _args(**kw)
    assert needle in str(e.value)


@pytest.mark.parametrize("kw, flag", [
    (dict(enable_afd=True), "--enable-afd"),
    (dict(enable_tokenweave=True), "--enable-tokenweave"),
    (dict(enable_tdist_overlap=True), "--enable-tdist-overlap"),
    (dict(disaggregation_mode="prefill", disaggregation_transfer_backend="fake"), "--disaggregation-mode"),
])
def test_combinations_refused_before_any_process(kw, flag):
    with pytest.raises(ValueError) as e:
        plan_deployment(_args(tp_size=2, dp_size=2, enable_dp_attention=True, **kw))
    assert "--enable-dp-attention" in str(e.value) and flag in str(e.value), str(e.value)


def test_cli_alias_and_dry_run_refusal_are_one_line():
    from sglang.srt.server_args import prepare_server_args

    a = prepare_server_args(["--tp", "2", "--data-parallel-size", "2", "--enable-dp-attention", "--device", "cpu"])
    assert (a.dp_size, a.tp_size, a.enable_dp_attention, a.load_balance_method) == (2, 2, True, "shortest_queue")
    p = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--dry-run", "--device", "cpu", "--tp", "4",
                        "--dp-size", "2", "--enable-dp-attention"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "use --dp-size 4 --tp-size 4" in p.stdout + p.stderr


# ---- plan and wiring ----------------------------------------------------------------------------------------------
def test_plan_has_one_scheduler_per_dp_rank_on_one_rendezvous():
    from sglang.srt.deployment.wiring import wire_local

    args = _args(tp_size=4, dp_size=4, ep_size=4, enable_dp_attention=True)
    plan = plan_deployment(args)
    assert plan.techniques == ("dp_attention",) and plan.scheduler_groups == 4
    assert [(w.name, w.group, w.rank, w.tp_size, w.dp_attention.dp_rank, w.dp_attention.moe_ep_size)
            for w in plan.workers] == [(f"sglang::scheduler_DP{r}", r, r, 4, r, 4) for r in range(4)]
    assert any("dp attention: 4 DP ranks" in n for n in plan.notes)
    assert "sglang::scheduler_DP3" in render_plan(plan)
    ports = iter(range(42000, 42010))
    bound, front = wire_local(plan, args, PortArgs.init_new("ipc"), lambda: next(ports))
    assert len({w.wiring.dist_init for w in bound}) == 1  # one world for the MoE collectives
    assert len(front.dp_scheduler_inputs) == 4 and front.dp_wake_peers
    assert [w.wiring.port_args.scheduler_input_ipc for w in bound] == list(front.dp_scheduler_inputs)


def test_afd_groups_keep_their_own_rendezvous_and_no_wake():
    from sglang.srt.deployment.wiring import wire_local

    args = _args(enable_afd=True, afd_attention_workers=2, tp_size=2)
    ports = iter(range(42100, 42110))
    bound, front = wire_local(plan_deployment(args), args, PortArgs.init_new("ipc"), lambda: next(ports))
    assert not front.dp_wake_peers and len({w.wiring.dist_init for w in bound if w.is_scheduler}) == 2


def test_model_check_names_the_split_it_cannot_make(tmp_path):
    from sglang.srt.dp_attention import deploy

    deploy.check_model(_args(model_path=shared_path("models", "stories260K-moe8"), tp_size=4, dp_size=4, ep_size=4,
                             enable_dp_attention=True))
    deploy.check_model(_args(model_path=shared_path("models", "stories260K"), tp_size=2, dp_size=2,
                             enable_dp_attention=True))  # dense: allowed (SGLang allows it)
    with pytest.raises(ValueError, match="needs a MoE model"):
        deploy.check_model(_args(model_path=shared_path("models", "stories260K"), tp_size=2, dp_size=2, ep_size=2,
                                 enable_dp_attention=True))
    with pytest.raises(ValueError, match="not divisible by --dp-size/--ep-size=4"):  # 172 % 4 == 0, 8 experts
        cfg = (tmp_path / "config.json")
        import json

        c = json.load(open(shared_path("models", "stories260K-moe8", "config.json")))
        c["intermediate_size"] = 170
        cfg.write_text(json.dumps(c))
        deploy.check_model(_args(model_path=str(tmp_path), tp_size=4, dp_size=4, ep_size=1,
                                 enable_dp_attention=True))


@pytest.mark.parametrize("backend", ["nccl", "tdist"])
def test_dp_workers_get_the_all_to_all_with_the_local_token_scope(backend, monkeypatch):
    if backend == "tdist":  # the plan's tdist check on CPU (the kernels run only in the interpreter)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        pytest.importorskip("triton")
        pytest.importorskip("sgl_kernel")
    plan = plan_deployment(_args(tp_size=4, dp_size=4, ep_size=4, enable_dp_attention=True,
                                 moe_a2a_backend=backend, enable_two_batch_overlap=True, tbo_min_tokens=2))
    assert {(w.moe_a2a.backend, w.moe_a2a.token_scope) for w in plan.workers} == {(backend, "local")}
    assert {w.executor.name for w in plan.workers} == {"two_batch_overlap"}
    assert {w.dp_attention.moe_a2a_backend for w in plan.workers} == {backend}
    note = next(n for n in plan.notes if n.startswith("moe a2a"))
    assert "each DP rank dispatches its own requests' tokens (token scope local)" in note and "1/4" not in note
    tp = plan_deployment(_args(tp_size=2, ep_size=2, moe_a2a_backend=backend))  # TP attention keeps tp_slice
    assert {w.moe_a2a.token_scope for w in tp.workers} == {"tp_slice"}
    assert plan_deployment(_args(tp_size=2, dp_size=2, enable_dp_attention=True)).workers[0].moe_a2a is None


def test_dp_install_refuses_a_tp_slice_scope():
    from sglang.srt.deployment.plan import MoeA2aSpec
    from sglang.srt.dp_attention.moe_a2a import install

    assert install(None, None, None, None, "cpu", 1) is None
    with pytest.raises(ValueError, match="needs token scope 'local', the plan gave 'tp_slice'"):
        install(None, MoeA2aSpec("nccl", "tp_slice"), None, None, "cpu", 1)


# ---- router ---------------------------------------------------------------------------------------------------
def test_shortest_queue_fills_the_emptiest_rank_and_ties_go_in_turn():
    r = DpRouter(3)
    assert [r.pick(f"a{i}") for i in range(3)] == [0, 1, 2]  # all empty: in turn
    r.release("a1")
    assert r.pick("b") == 1 and r.loads == [1, 1, 1]  # the emptiest
    r.release("a0"), r.release("a2")
    assert r.pick("c") == 2  # tie between 0 and 2: in turn after the last pick (1)
    assert r.pick("c") == 2 and r.loads == [0, 1, 1]  # a placed rid keeps its rank, counted once
    assert r.owner("b") == 1 and r.owner("zz") is None
    r.release("b"), r.release("b")  # idempotent
    assert r.loads == [0, 0, 1]


def test_one_request_after_another_alternates_like_round_robin():
    r = DpRouter(4)
    picks = []
    for i in range(8):
        picks.append(r.pick(f"r{i}"))
        r.release(f"r{i}")
    assert picks == [0, 1, 2, 3, 0, 1, 2, 3]


def test_round_robin_ignores_load():
    r = DpRouter(2, "round_robin")
    assert [r.pick(f"r{i}") for i in range(4)] == [0, 1, 0, 1] and r.loads == [2, 2]
    with pytest.raises(ValueError, match="--load-balance-method"):
        DpRouter(2, "random")


# ---- step agreement --------------------------------------------------------------------------------------------
def _sizes(bs):  # captured 1, 2, 4, 8
    return next((s for s in (1, 2, 4, 8) if s >= bs), None)


def test_no_tokens_anywhere_means_no_forward_and_blocking_only_when_nobody_has_work():
    s = decide([DpRankReport(0, False, 0), DpRankReport(0, False, 0)], _sizes)
    assert not s.runs_forward and not s.any_work
    s = decide([DpRankReport(0, True, 0), DpRankReport(0, False, 0)], _sizes)  # e.g. a grammar compiling
    assert not s.runs_forward and s.any_work


def test_one_rank_with_tokens_makes_every_rank_run_and_pads_to_the_largest():
    s = decide([DpRankReport(37, True, NO_GRAPH), DpRankReport(0, False, 0), DpRankReport(3, True, 3)], _sizes)
    assert s.runs_forward and s.graph_bs == 0 and s.rows_per_rank == 37 and s.num_tokens == (37, 0, 3)


def test_decode_everywhere_replays_one_padded_graph_size():
    s = decide([DpRankReport(3, True, 3), DpRankReport(0, False, 0), DpRankReport(5, True, 5)], _sizes)
    assert s.graph_bs == 8 and s.rows_per_rank == 8
    assert decide([DpRankReport(9, True, 9)], _sizes).graph_bs == 0  # larger than any graph: eager
    assert decide([DpRankReport(3, True, 3)], None).graph_bs == 0  # no graphs at all


def test_micro_batch_split_only_when_every_rank_splits():
    both = [DpRankReport(40, True, NO_GRAPH, True), DpRankReport(30, True, NO_GRAPH, True)]
    assert decide(both).split_all
    assert not decide(both[:1] + [DpRankReport(30, True, NO_GRAPH, False)]).split_all
    assert not decide(both[:1] + [DpRankReport(0, False, 0)]).split_all  # an idle rank never splits


def test_all_to_all_mode_low_latency_only_without_a_prefill_anywhere():
    """SGLang's DeepEP ``auto`` rule: low-latency when no DP rank has an extend (prefill / mixed) batch; here also only
    when every decode fits the dispatcher's low-latency capacity (the same number on every rank)."""
    dec3, dec5, idle = DpRankReport(3, True, NO_GRAPH, decode=True), DpRankReport(5, True, NO_GRAPH, decode=True), \
        DpRankReport(0, False, 0)
    ext = DpRankReport(5, True, NO_GRAPH, decode=False)
    assert decide([dec3, idle, dec5], None, 8).moe_dispatch_mode == "low_latency"  # eager decodes, one idle rank
    assert decide([dec3, ext], None, 8).moe_dispatch_mode == "normal"  # a prefill / mixed batch somewhere
    assert decide([dec3, dec5], None, 4).moe_dispatch_mode == "normal"  # 5 > the capacity 4
    assert decide([dec3, dec5], None, None).moe_dispatch_mode == "normal"  # no dispatcher
    assert decide([idle, idle], None, 8).moe_dispatch_mode == "normal" and not decide([idle, idle], None, 8).low_latency
    graphed = decide([DpRankReport(3, True, 3, decode=True), idle], _sizes, None)
    assert graphed.graph_bs == 4 and graphed.moe_dispatch_mode == "low_latency"  # a replay always is


def test_local_report_reads_the_batch_and_the_executor():
    from types import SimpleNamespace

    from sglang.srt.dp_attention.scheduler_hook import local_report
    from sglang.srt.forward_batch_info import ForwardMode

    def req(n):
        return SimpleNamespace(extend_len=n, input_logprob_targets=lambda: ([], []))

    dec = SimpleNamespace(reqs=[req(1)] * 3, forward_mode=ForwardMode.DECODE)
    assert local_report(dec, True, 8) == DpRankReport(3, True, 3, False, True)
    assert local_report(dec, True, 2).graph_bs == NO_GRAPH  # larger than the largest graph
    assert local_report(dec, True, None).graph_bs == NO_GRAPH  # no graphs
    ext = SimpleNamespace(reqs=[req(7), req(1)], forward_mode=ForwardMode.MIXED)
    assert local_report(ext, True, 8, lambda b: True) == DpRankReport(8, True, NO_GRAPH, True)
    assert local_report(None, False, 8, lambda b: True) == DpRankReport(0, False, 0, False)


def test_step_sync_over_an_exchange_agrees_and_counts():
    rows = [[4, 1, 4, 0, 1], [0, 0, 0, 0, 0]]
    sync = DpStepSync(1, 2, exchange=lambda mine: rows[:1] + [mine], graph_size=_sizes)
    step = sync.agree(DpRankReport(0, False, 0))
    assert step.num_tokens == (4, 0) and step.graph_bs == 4 and sync.peers_busy and sync.steps == 1
    eager = DpStepSync(1, 2, exchange=lambda mine: rows[:1] + [mine], low_latency_capacity=4)
    assert eager.agree(DpRankReport(0, False, 0)).moe_dispatch_mode == "low_latency"  # rank 0 decodes 4, 1 idle
    with pytest.raises(ValueError):
        DpStepSync(2, 2, exchange=lambda m: [m])


# ---- MoE packing --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_round_trip_pads_with_weight_zero(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=g).to(dtype)
    w = torch.rand(3, 2, generator=g)
    ids = torch.randint(0, 8, (3, 2), generator=g)
    buf = pack_rows(x, w, ids, 5)
    assert buf.dtype == torch.uint8 and buf.shape[0] == 5
    x2, w2, ids2 = unpack_rows(buf, 16, 2, dtype)
    assert torch.equal(x2[:3], x) and torch.equal(w2[:3], w) and torch.equal(ids2[:3], ids)
    assert not x2[3:].any() and not w2[3:].any() and not ids2[3:].any()
    with pytest.raises(ValueError):
        pack_rows(x, w, ids, 2)


def test_padding_rows_come_from_the_step_or_fail_loudly():
    p = DpForwardPadding()
    p.set(6)
    assert p.rows_for(4, None, torch.device("cpu")) == 6
    with pytest.raises(RuntimeError, match="agreed on at most 6"):
        p.rows_for(7, None, torch.device("cpu"))
    with pytest.raises(ValueError):
        p.set(0)


# ---- the front end: routing and wake-ups on the real sockets ------------------------------------------------------
def test_tokenizer_manager_routes_by_queue_and_wakes_the_other_dp_ranks():
    import asyncio
    import dataclasses
    import os

    import zmq

    from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput, WakeUpReq, decode_msg
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    pa = PortArgs.init_new()
    pa = dataclasses.replace(pa, dp_scheduler_inputs=tuple(f"{pa.scheduler_input_ipc}-dp{a}" for a in range(3)),
                             dp_wake_peers=True)
    ctx = zmq.Context()
    pulls = []
    for addr in pa.dp_scheduler_inputs:
        s = ctx.socket(zmq.PULL)
        s.bind(addr)
        pulls.append(s)
    info = {"context_len": 64, "max_total_tokens": 256, "vocab_size": 512, "max_req_input_len": 63}

    def drain(sock) -> list:
        out = []
        while sock.poll(200):
            out.append(decode_msg(sock.recv()))
        return out

    async def go():
        tm = TokenizerManager(ServerArgs(model_path=os.devnull, skip_tokenizer_init=True), pa, info)
        try:
            for rid in ("a", "b", "c"):
                tm._send(TokenizedGenerateReqInput(rid=rid, input_ids=[1], sampling_params={}))
            got = [drain(s) for s in pulls]
            tm._dp_router.release("b")  # rank 1 is now the emptiest
            tm._send(TokenizedGenerateReqInput(rid="d", input_ids=[1], sampling_params={}))
            tm._send(AbortReq(rid="d"))
            return got, [drain(s) for s in pulls]
        finally:
            tm.close()

    try:
        first, second = asyncio.run(go())
    finally:
        for s in pulls:
            s.close(linger=0)
        ctx.term()
    for rank, msgs in enumerate(first):  # each rank: its own request, and a wake for each of the other two
        reqs = [m.rid for m in msgs if isinstance(m, TokenizedGenerateReqInput)]
        assert reqs == ["abc"[rank]] and sum(isinstance(m, WakeUpReq) for m in msgs) == 2, msgs
    assert [type(m).__name__ for m in second[1]] == ["TokenizedGenerateReqInput", "AbortReq"]  # the abort follows
    assert [type(m).__name__ for m in second[0]] == [type(m).__name__ for m in second[2]] == ["WakeUpReq"]
