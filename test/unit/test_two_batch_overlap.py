"""Two-batch overlap, in one process: the micro-batch split rules (balance, the token-distribution threshold, request
vs token cuts, a request straddling the cut in extend), the auto-off table, the executor's choice and its log, the
cross-stream memory holds, and the flags / deployment plan. The multi-rank token equality is in
``test_two_batch_overlap_ep.py``."""

from __future__ import annotations

import logging
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import shared_path  # noqa: E402

from sglang.srt.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.two_batch_overlap.auto_off import (  # noqa: E402
    AUTO_MIN_TOKENS,
    TBO_OFF,
    Threshold,
    auto_threshold,
    resolve_threshold,
)
from sglang.srt.two_batch_overlap.executor import (  # noqa: E402
    TboConfig,
    TwoBatchOverlapExecutor,
    _refs,
    moe_block_communicates,
)
from sglang.srt.two_batch_overlap.split import (  # noqa: E402
    balanced_request_cut,
    plan_micro_batches,
    request_of_token,
    split_decode,
    split_extend,
)

FORCED = Threshold(2, False, "forced on by the test")


# ---- the split rules ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lens, cut", [([5, 5], 1), ([1, 1, 1, 1], 2), ([8, 1, 1, 6], 1), ([3, 3, 3], 2),
                                       ([1, 9], 1), ([4], 0), ([], 0), ([2, 2, 4], 2)])
def test_balanced_request_cut(lens, cut):
    assert balanced_request_cut(lens) == cut
    if len(lens) >= 2:  # brute force: no request boundary balances better (ties go to the later one)
        diffs = [abs(2 * sum(lens[:i]) - sum(lens)) for i in range(1, len(lens))]
        assert abs(2 * sum(lens[:cut]) - sum(lens)) == min(diffs)
        assert cut == max(i + 1 for i, d in enumerate(diffs) if d == min(diffs))


def test_decode_splits_by_requests_balanced():
    for bs in range(2, 40):
        s = split_decode(bs)
        assert s.by == "requests" and s.straddling is None
        assert s.tokens_a + s.tokens_b == bs and abs(s.tokens_a - s.tokens_b) <= 1
    assert split_decode(1) is None and split_decode(0) is None
    # decode batches are cut by requests whatever the threshold
    assert plan_micro_batches(True, [1] * 7, threshold=0.5).token_cut == 4


def test_extend_cuts_between_requests_when_balanced_enough():
    s = split_extend([100, 100, 100, 100], 0.48)
    assert (s.by, s.token_cut, s.straddling) == ("requests", 200, None)


def test_extend_cuts_inside_a_request_below_the_threshold():
    # one long prefill: no request boundary at all -> half of the tokens, the request straddles the cut
    s = split_extend([1000], 0.48)
    assert (s.by, s.token_cut, s.straddling) == ("tokens", 500, 0)
    # a long prompt beside short ones: the best boundary leaves 10 / 1010 tokens on one side
    s = split_extend([10, 1000], 0.48)
    assert (s.by, s.token_cut, s.straddling) == ("tokens", 505, 1)
    assert request_of_token([10, 1000], 505) == (1, 10)
    # the same batch with the threshold at 0: the request boundary, however unbalanced
    # the best boundary of [100, 90, 110, 100] leaves 190 / 400 = 0.475 < 0.48: cut at 200, inside request 2
    s = split_extend([100, 90, 110, 100], 0.48)
    assert (s.by, s.token_cut, s.straddling) == ("tokens", 200, 2)
    assert split_extend([100, 90, 110, 100], 0.45).token_cut == 190  # 0.475 is enough at 0.45
    s = split_extend([10, 1000], 0.0)
    assert (s.by, s.token_cut, s.straddling) == ("requests", 10, None)
    assert split_extend([1000], 0.0) is None


@pytest.mark.parametrize("threshold", [0.0, 0.2, 0.3, 0.45, 0.48, 0.5])
def test_threshold_meaning_on_random_batches(threshold):
    gen = torch.Generator().manual_seed(7)
    for _ in range(300):
        n = int(torch.randint(1, 7, (1,), generator=gen))
        lens = torch.randint(1, 300, (n,), generator=gen).tolist()
        s = split_extend(lens, threshold)
        total = sum(lens)
        left = sum(lens[:balanced_request_cut(lens)])
        balanced = threshold * total <= left <= (1 - threshold) * total
        if threshold > 0 and not balanced:
            assert s.by == "tokens" and s.token_cut == total // 2
        elif balanced_request_cut(lens) == 0:
            assert s is None
        else:
            assert s.by == "requests" and s.token_cut == left
        if s is not None:
            assert 1 <= s.token_cut <= total - 1


def test_bad_threshold_and_lens():
    for t in (-0.1, 0.51, 1.0):
        with pytest.raises(ValueError, match="tbo-token-distribution-threshold"):
            split_extend([4, 4], t)
    with pytest.raises(ValueError, match="new tokens"):
        split_extend([4, 0], 0.48)
    assert split_extend([1], 0.48) is None  # one token cannot be split


# ---- the split on a real ForwardBatch ----------------------------------------------------------------------------
def _harness():
    from model_harness import ModelHarness

    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=4, dtype=torch.float32)
    return ModelHarness(None, cfg, max_reqs=8, max_len=64)


def _executor(min_tokens: int = 2, threshold: float = 0.48) -> TwoBatchOverlapExecutor:
    return TwoBatchOverlapExecutor(TboConfig(threshold, Threshold(min_tokens, False, "test")), "cpu")


def test_plan_straddling_request_continues_as_extend_in_b():
    h = _harness()
    h.prepare([("a", list(range(3, 9)))])  # a: 6 tokens of KV already
    fb = h.prepare([("a", [20]), ("b", list(range(3, 43)))])  # mixed: a decodes, b prefills 40 tokens
    assert fb.forward_mode == ForwardMode.MIXED
    a, b = _executor().plan(fb)  # best boundary 1 / 41 < 0.48: cut at 20, b straddles
    assert a.token_range == (0, 20) and b.token_range == (20, 41)
    assert a.extend_lens_cpu == [1, 19] and a.prefix_lens_cpu == [6, 0]
    assert b.extend_lens_cpu == [21] and b.prefix_lens_cpu == [19] and b.seq_lens_cpu == [40]
    assert b.req_pool_indices_cpu == [fb.req_pool_indices_cpu[1]]
    assert torch.equal(torch.cat([a.input_ids, b.input_ids]), fb.input_ids)


def test_plan_decode_by_views_and_extend_by_requests():
    h = _harness()
    h.prepare([(i, [3, 4, 5]) for i in range(5)])
    fb = h.prepare([(i, [7]) for i in range(5)])
    a, b = _executor().plan(fb)
    assert (a.batch_size, b.batch_size) == (3, 2)
    assert a.input_ids.data_ptr() == fb.input_ids.data_ptr()  # views: no host-to-device copy (graph-capturable)
    fb = h.prepare([(10, list(range(3, 13))), (11, list(range(3, 13)))])
    a, b = _executor().plan(fb)
    assert (a.batch_size, b.batch_size, a.num_tokens) == (1, 1, 10)


def test_plan_below_threshold_or_uncuttable_runs_unsplit():
    h = _harness()
    fb = h.prepare([("a", list(range(3, 40)))])
    ex = _executor(min_tokens=64)
    subs = ex.plan(fb)
    assert len(subs) == 1 and subs[0] is fb and ex.last_split is None
    ex = _executor()
    one = h.prepare([("b", [5])])  # one token cannot be cut
    subs = ex.plan(one)
    assert len(subs) == 1 and subs[0] is one and ex.last_split is None


def test_dp_attention_report_and_agreement():
    """DP attention: the rank reports whether it would split a scheduler batch (``dp_split_ok``); every rank then
    follows the step's agreement (``forward_batch.dp_step.split_all``)."""
    from sglang.srt.forward_batch_info import ForwardMode as FM

    def sched(mode, lens):
        return SimpleNamespace(forward_mode=mode, reqs=[SimpleNamespace(extend_len=n) for n in lens])

    ex = _executor(min_tokens=8)
    assert ex.dp_split_ok(sched(FM.EXTEND, [37]))
    assert not ex.dp_split_ok(sched(FM.EXTEND, [5]))  # below the threshold
    assert ex.dp_split_ok(sched(FM.DECODE, [1] * 8)) and not ex.dp_split_ok(sched(FM.DECODE, [1] * 7))
    assert not ex.dp_split_ok(sched(FM.IDLE, []))
    assert not _executor(threshold=0.0).dp_split_ok(sched(FM.EXTEND, [40]))  # one request, no token cut allowed
    h = _harness()
    fb = h.prepare([("a", list(range(3, 40)))])
    fb.dp_step = SimpleNamespace(split_all=False)  # another rank would not split: nobody does
    subs = ex.plan(fb)
    assert len(subs) == 1 and subs[0] is fb and ex.last_split is None
    fb.dp_step = SimpleNamespace(split_all=True)
    assert len(ex.plan(fb)) == 2
    small = h.prepare([("c", [5, 6])])
    small.dp_step = SimpleNamespace(split_all=True)  # an agreement this rank cannot follow: fail, never hang
    with pytest.raises(RuntimeError, match="agreed to split"):
        ex.plan(small)


def test_choice_is_logged_once_per_change(caplog):
    h = _harness()
    ex = _executor(min_tokens=16)
    big = [("p", list(range(3, 40)))]
    with caplog.at_level(logging.DEBUG, logger="sglang.srt.two_batch_overlap.executor"):
        for items in (big, [("q", [5, 6])], [("r", [5, 6, 7])], [("s", list(range(3, 40)))], [("t", [4, 5])]):
            ex.plan(h.prepare(items))
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(info) == 2 and "on: 37-token extend batch split" in info[0] and "off: 2-token extend" in info[1]
    assert "below the threshold (16 tokens" in info[1]
    assert len(debug) == 2  # the same two choices again: logged at DEBUG only; the unchanged 3-token batch not at all


# ---- auto-off ----------------------------------------------------------------------------------------------------
def test_auto_off_table():
    assert auto_threshold(1, "NVIDIA H100 80GB HBM3").min_tokens == TBO_OFF
    assert auto_threshold(4, "", "cpu").min_tokens == TBO_OFF  # no streams on CPU: nothing overlaps
    h2 = auto_threshold(2, "NVIDIA H200")
    assert h2 is AUTO_MIN_TOKENS[("H200", 2)] and not h2.measured and "not measured" in h2.source
    assert auto_threshold(16, "NVIDIA H100 80GB HBM3") is AUTO_MIN_TOKENS[("H100", 8)]  # nearest smaller EP
    assert auto_threshold(2, "NVIDIA B200") is AUTO_MIN_TOKENS[("H100", 2)]  # unknown GPU: the H100 rows
    assert all(not t.measured for t in AUTO_MIN_TOKENS.values())  # said honestly until a benchmark replaces them
    forced = resolve_threshold(2, 1, "", "cpu")
    assert forced.min_tokens == 2 and forced.source == "--tbo-min-tokens"
    with pytest.raises(ValueError, match="tbo-min-tokens"):
        resolve_threshold(1, 2)
    assert "off (unmeasured" in auto_threshold(1).describe()


def test_graph_capture_choice():
    ex = TwoBatchOverlapExecutor(TboConfig(threshold=FORCED, graph_max_bs=160), "cpu")
    assert not ex.graph_captures_executor  # no CUDA stream here
    ex.comm_stream = object()  # as on CUDA: forced on -> graphs capture the split schedule
    assert ex.graph_captures_executor
    ex2 = TwoBatchOverlapExecutor(TboConfig(threshold=Threshold(4096, False, "t"), graph_max_bs=160), "cpu")
    ex2.comm_stream = object()
    assert not ex2.graph_captures_executor  # every graphed batch is below the threshold: plain graphs
    with pytest.raises(ValueError):
        TboConfig(token_distribution_threshold=0.6)


# ---- cross-stream memory holds (the bookkeeping, with stand-in streams) ------------------------------------------
def test_objects_dropped_by_a_stage_are_held_until_the_other_stream_follows():
    from sglang.srt.layers.stages import LayerState

    ex = _executor()
    compute, comm = object(), object()
    ex._compute, ex.comm_stream = compute, comm
    st = LayerState(torch.zeros(2), None, torch.zeros(2), None)
    key = id(st)
    ex._held = {key: []}
    t_attn = st.hidden
    before = _refs(st)
    st.hidden = torch.ones(2)  # a compute stage replaced the hidden state
    ex._hold(key, compute, before, st)
    assert ex._held[key] == [([t_attn], comm)]  # the comm stream may still read it: held
    before = _refs(st)
    ex._hold(key, compute, before, st)  # another compute stage: still held
    assert len(ex._held[key]) == 1
    before = _refs(st)
    st.hidden = torch.full((2,), 2.0)
    ex._hold(key, comm, before, st)  # a comm stage of the same micro-batch (it waited for the chain): released
    assert [h[1] for h in ex._held[key]] == [compute] and ex._held[key][0][0][0] is not t_attn


def test_moe_block_communicates():
    assert not moe_block_communicates(SimpleNamespace(a2a=None))  # the all-reduce EP: no all-to-all runner
    assert not moe_block_communicates(SimpleNamespace())
    assert moe_block_communicates(SimpleNamespace(a2a=object()))
    assert not moe_block_communicates(SimpleNamespace(a2a=SimpleNamespace(communicates=False)))


# ---- the forward on one process ----------------------------------------------------------------------------------
def test_forced_split_gives_the_unsplit_logits_on_moe8():
    from model_harness import ModelHarness

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    path = shared_path("models", "stories260K-moe8")
    config = ModelConfig.from_path(path)
    model = load_model(config, "auto", "cpu")
    ex = _executor()
    steps = [[("a", [3, 17, 5, 9, 22, 41, 7]), ("b", [8, 1, 60, 2])],
             [("a", [11]), ("c", [4, 4, 90, 13, 5, 6, 7, 8, 9, 10, 11, 12, 13])],  # mixed, c straddles
             [("a", [12]), ("b", [30]), ("c", [6])]]
    ref, got = ModelHarness(model, config), ModelHarness(model, config)
    kinds = []
    for items in steps:
        want = ref.step(items)
        out = got.step(items, ex)  # KV slots NaN-poisoned first: a read before the write shows up
        kinds.append((ex.last_split.by, ex.last_split.straddling))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(out.argmax(-1), want.argmax(-1))
    assert kinds == [("tokens", 0), ("tokens", 1), ("requests", None)]


# ---- flags and the deployment plan -------------------------------------------------------------------------------
def test_flags_and_plan():
    from sglang.srt.deployment import plan_deployment
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    args = prepare_server_args(["--model-path", "m", "--device", "cpu", "--tp", "2", "--ep-size", "2",
                                "--enable-two-batch-overlap", "--tbo-token-distribution-threshold", "0.3",
                                "--tbo-min-tokens", "2"])
    plan = plan_deployment(args)
    spec = plan.workers[0].executor
    assert plan.techniques == ("two_batch_overlap",) and spec.name == "two_batch_overlap"
    assert spec.opts() == {"token_distribution_threshold": 0.3, "min_tokens": 2, "ep_size": 2, "graph_max_bs": 0}
    assert ServerArgs(device="cpu").tbo_token_distribution_threshold == 0.48  # SGLang's default
    with pytest.raises(ValueError, match="--tbo-token-distribution-threshold=0.7"):
        ServerArgs(device="cpu", enable_two_batch_overlap=True, tbo_token_distribution_threshold=0.7)
    with pytest.raises(ValueError, match="--tbo-min-tokens=1"):
        ServerArgs(device="cpu", enable_two_batch_overlap=True, tbo_min_tokens=1)
    with pytest.raises(ValueError, match="together with --enable-two-batch-overlap"):
        ServerArgs(device="cpu", tbo_min_tokens=8)
    for kw, flag in ((dict(enable_tokenweave=True, tp_size=2), "--enable-tokenweave"),
                     (dict(enable_tdist_overlap=True, tp_size=2), "--enable-tdist-overlap"),
                     (dict(enable_afd=True), "--enable-afd")):
        with pytest.raises(ValueError, match=f"--enable-two-batch-overlap and {flag} cannot be combined"):
            plan_deployment(ServerArgs(device="cpu", enable_two_batch_overlap=True, **kw))


def test_executor_from_the_registry_logs_its_threshold(caplog):
    from sglang.srt.deployment.plan import ExecutorSpec
    from sglang.srt.model_executor.executors import ExecutorContext, build_executor

    spec = ExecutorSpec.of("two_batch_overlap", token_distribution_threshold=0.48, min_tokens=None, ep_size=2,
                           graph_max_bs=0)
    with caplog.at_level(logging.INFO, logger="sglang.srt.two_batch_overlap.deploy"):
        ex = build_executor(spec, ExecutorContext(device=torch.device("cpu")))
    assert isinstance(ex, TwoBatchOverlapExecutor) and ex.config.min_tokens == TBO_OFF
    assert "no GPU" in caplog.text and "EP 2" in caplog.text and "nothing to overlap" not in caplog.text
    model = torch.nn.Module()  # a model without communicating stages (one rank): said at startup
    model.decoder_layers = []
    with caplog.at_level(logging.INFO, logger="sglang.srt.two_batch_overlap.deploy"):
        build_executor(spec, ExecutorContext(device=torch.device("cpu"), model=model))
    assert "nothing to overlap" in caplog.text


def test_decode_split_without_host_rows_reads_nothing_back():
    """The CUDA-graph runner's decode batches carry no host request rows; the views-only split then gives parts
    without them instead of reading the device rows back (a synchronization a graph capture forbids)."""
    import dataclasses

    from sglang.srt.batch_split import split_decode_requests

    h = _harness()
    h.prepare([(i, [3, 4]) for i in range(3)])
    fb = dataclasses.replace(h.prepare([(i, [9]) for i in range(3)]), req_pool_indices_cpu=[])
    a, b = split_decode_requests(fb, 2)
    assert a.req_pool_indices_cpu == [] and b.req_pool_indices_cpu == []
    assert torch.equal(torch.cat([a.req_pool_indices, b.req_pool_indices]), fb.req_pool_indices)


def test_sub_batches_keep_the_step_attributes():
    """What the runner attaches to a batch for the whole step outside the dataclass fields (DP attention: the MoE
    all-to-all mode and the step every rank agreed on) reaches every micro-batch, else ranks could dispatch in
    different modes."""
    h = _harness()
    h.prepare([(i, [3, 4]) for i in range(4)])
    for fb in (h.prepare([(i, [9]) for i in range(4)]), h.prepare([("x", list(range(3, 30)))])):
        fb.moe_dispatch_mode, fb.dp_step = "normal", SimpleNamespace(split_all=True)
        subs = _executor().plan(fb)
        assert len(subs) == 2
        assert all(s.moe_dispatch_mode == "normal" and s.dp_step is fb.dp_step for s in subs)
