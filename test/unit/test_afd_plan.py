"""AFD deployment-plan search (MegaScale-Infer sec. 4.2-4.3): pipeline timing, Algorithm 1, profiles, CLI."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import shared_path
from sglang.srt.afd.planner import plan as plan_mod
from sglang.srt.afd.planner import profiler
from sglang.srt.afd.planner.gpu_specs import get_gpu_spec
from sglang.srt.afd.planner.model_spec import MoEModelSpec
from sglang.srt.afd.planner.perf_model import (PROFILE_SCHEMA, build_perf_model, fit_linear, fit_node_cost,
                                               load_profile)
from sglang.srt.afd.planner.plan import PlanInfeasibleError, SearchLimits, best_afd_plan, search_plans
from sglang.srt.afd.planner.simulator import iteration_time, min_micro_batches, simulate_fleet, simulate_pipeline

# Table 4 of the paper (layers, hidden, experts, top-k, intermediate); attention shapes from the public
# Mixtral-8x22B / DBRX configs, Scaled-MoE's assumed (64 heads, 8 KV heads, head_dim 128).
TABLE4 = {
    "Mixtral-8x22B": dict(num_layers=56, hidden_size=6144, num_heads=48, num_kv_heads=8, head_dim=128,
                          num_experts=8, top_k=2, moe_intermediate_size=16384, vocab_size=32768),
    "DBRX": dict(num_layers=40, hidden_size=6144, num_heads=48, num_kv_heads=8, head_dim=128,
                 num_experts=16, top_k=4, moe_intermediate_size=10752, vocab_size=100352),
    "Scaled-MoE": dict(num_layers=48, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
                       num_experts=32, top_k=4, moe_intermediate_size=8192, vocab_size=128256),
}
TABLE4_PARAMS_B = {"Mixtral-8x22B": 141, "DBRX": 132, "Scaled-MoE": 317}
TINY = {"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256}


def _table4(name):
    return MoEModelSpec.from_hf_config({"name": name, **TABLE4[name]})


# ---------------------------------------------------------------- pipeline timing (eq. 1-4)
def test_min_micro_batches_is_three_when_comm_under_half_compute():
    rng = np.random.default_rng(0)
    t_f = rng.uniform(1e-4, 1e-2, 1000)
    assert np.all(min_micro_batches(t_f * rng.uniform(1e-6, 0.5, 1000), t_f) == 3)
    assert np.all(min_micro_batches(t_f * rng.uniform(0.501, 0.999, 1000), t_f) == 4)
    assert np.all(min_micro_batches(0.0, t_f) == 2)


@pytest.mark.parametrize("layers", [1, 3, 8])
def test_closed_form_iteration_time_equals_event_replay(layers):
    rng = np.random.default_rng(layers)
    t_a, t_e, t_c = (rng.uniform(0.05, 1.0, 4000) for _ in range(3))
    for m in range(1, 7):
        cf = iteration_time(t_a, t_e, t_c, m, layers)
        np.testing.assert_allclose(cf, simulate_pipeline(t_a, t_e, t_c, m, layers), rtol=1e-12)
        ok = m >= 2 * (1 + t_c / np.maximum(t_a, t_e))  # eq. 4 exactly where eq. 3 holds
        eq4 = t_a + t_e + 2 * t_c + np.maximum(t_a, t_e) * (m * layers - 1)
        np.testing.assert_allclose(cf[ok], eq4[ok], rtol=1e-12)
        assert np.all(cf[~ok] > eq4[~ok] - 1e-12)  # bubbles never make it faster than eq. 4


# ---------------------------------------------------------------- model configs
def test_shared_configs_parse_and_dense_is_refused():
    q = MoEModelSpec.from_path(shared_path("configs", "Qwen--Qwen3-30B-A3B"))
    assert (q.num_experts, q.top_k, q.moe_intermediate_size, q.num_moe_layers) == (128, 8, 768, 48)
    assert 29e9 < q.total_params < 32e9
    mx = MoEModelSpec.from_path(shared_path("configs", "mistralai--Mixtral-8x7B-v0.1"))
    assert 45e9 < mx.total_params < 48e9
    with pytest.raises(ValueError, match="dense model"):
        MoEModelSpec.from_path(shared_path("configs", "meta-llama--Meta-Llama-3.1-8B"))


@pytest.mark.parametrize("name", list(TABLE4))
def test_table4_sizes_match_the_paper(name):
    assert abs(_table4(name).total_params / 1e9 - TABLE4_PARAMS_B[name]) / TABLE4_PARAMS_B[name] < 0.02


# ---------------------------------------------------------------- Algorithm 1
def test_plan_meets_every_constraint_and_m_at_least_three():
    model = MoEModelSpec.from_path(shared_path("configs", "mistralai--Mixtral-8x7B-v0.1"))
    lim = SearchLimits(tpot_slo_s=0.1, max_attention_nodes=64)
    perf = build_perf_model(model, "H20", "L40S", 1024)
    plans = search_plans(perf, lim, top=5)
    assert len(plans) >= 2 and plans[0].tokens_per_s_per_cost >= plans[1].tokens_per_s_per_cost
    for p in plans:
        t_f = max(p.t_a_ms, p.t_e_ms)
        assert p.t_c_ms < t_f / 2  # this setup hides communication easily ...
        assert p.m >= 3 and p.m >= 2 * (1 + p.t_c_ms / t_f)  # ... so eq. 3 asks for (at least) 3
        assert p.tpot_ms <= 100 + 1e-9 and p.global_batch == p.n_a * p.m * p.micro_batch_size
        assert p.n_e * p.experts_per_node == model.num_experts
        # the memory constraint: KV of all requests of an attention node fits beside its weights
        kv = perf.kv_bytes_per_request() * p.m * p.micro_batch_size
        assert kv + perf.attention_weight_bytes() <= p.tp_a * get_gpu_spec("H20").memory_bytes * 0.9
        t_a, t_e, t_c = perf.micro_batch_times(p.tp_a, p.tp_e, p.experts_per_node, p.n_a, p.micro_batch_size)
        assert float(iteration_time(t_a, t_e, t_c, p.m, model.num_layers)) * 1e3 == pytest.approx(p.tpot_ms)


def _scalar_best(perf, lim):
    """Exhaustive scalar search over every (tp_e, g, tp_a, n_a, m, b_a): the reference for the vectorized one."""
    model, best = perf.model, 0.0
    mem_a = perf.attn.gpu.memory_bytes * lim.mem_fraction
    for tp_e in (1, 2):
        for g in (1, 2, 4, 8):
            if float(perf.expert_weight_bytes(g)) > tp_e * perf.expert.gpu.memory_bytes * lim.mem_fraction:
                continue
            for tp_a in (1, 2):
                for n_a in range(1, lim.max_attention_nodes + 1):
                    for m in range(1, lim.max_micro_batches + 1):
                        b = np.arange(1, lim.max_micro_batch_size + 1)
                        t_a, t_e, t_c = perf.micro_batch_times(tp_a, tp_e, g, n_a, b)
                        t = iteration_time(t_a, t_e, t_c, m, model.num_layers)
                        t_f = np.maximum(t_a, t_e)
                        ok = ((t <= lim.tpot_slo_s) & (t_c < t_f) & (m >= 2 * (1 + t_c / t_f))
                              & (tp_a * mem_a - perf.attention_weight_bytes() >= m * b * perf.kv_bytes_per_request()))
                        if not ok.any():
                            continue
                        cost = (n_a * tp_a * perf.attn.gpu.price_per_hour
                                + model.num_experts // g * tp_e * perf.expert.gpu.price_per_hour)
                        best = max(best, float((n_a * m * b / t)[ok].max() / cost))
    return best


def test_vectorized_search_equals_exhaustive_scalar_search():
    model = MoEModelSpec.from_path(shared_path("configs", "mistralai--Mixtral-8x7B-v0.1"))
    lim = SearchLimits(tpot_slo_s=0.03, max_gpus_per_node=2, max_attention_nodes=6, max_micro_batches=5,
                       max_micro_batch_size=48)
    perf = build_perf_model(model, "H20", "L40S", 2048, tps=(1, 2))
    best = search_plans(perf, lim)[0]
    assert best.tokens_per_s_per_cost == pytest.approx(_scalar_best(perf, lim), rel=1e-9)


def test_expert_imbalance_costs_throughput():
    """A skewed router (max/mean expert-node load from load_balance) slows the expert side; never helps."""
    model = _table4("DBRX")
    rates = [best_afd_plan(model, "H20", "L40S", SearchLimits(tpot_slo_s=0.15, max_attention_nodes=64,
                                                                 expert_imbalance=x)).tokens_per_s_per_cost
             for x in (1.0, 1.5, 3.0)]
    assert rates[0] > rates[1] > rates[2]


@pytest.mark.parametrize("name", list(TABLE4))
def test_heterogeneous_h20_attention_l40s_experts_beats_homogeneous_per_cost(name):
    lim = SearchLimits(tpot_slo_s=0.15, max_attention_nodes=64)
    res = {pair: best_afd_plan(_table4(name), *pair, lim) for pair in
           [("H20", "L40S"), ("H20", "H20"), ("L40S", "L40S")]}
    het = res[("H20", "L40S")].tokens_per_s_per_cost
    assert het > res[("H20", "H20")].tokens_per_s_per_cost
    assert het > res[("L40S", "L40S")].tokens_per_s_per_cost


def test_infeasible_slo_and_memory_give_clear_errors():
    model = _table4("Mixtral-8x22B")
    with pytest.raises(PlanInfeasibleError, match=r"--tpot-slo-ms=1\b.*needs TPOT >= \d"):
        best_afd_plan(model, "H20", "L40S", SearchLimits(tpot_slo_s=1e-3))
    huge = MoEModelSpec.from_hf_config({**model.to_dict(), "moe_intermediate_size": 40960})  # 85 GB/expert
    msg = r"fits in memory \(one expert.s weights need 84.6 GB > 1xL40S \(43.2 GB usable\)\)"
    with pytest.raises(PlanInfeasibleError, match=msg):
        best_afd_plan(huge, "L40S", "L40S", SearchLimits(tpot_slo_s=1.0, max_gpus_per_node=1))
    with pytest.raises(PlanInfeasibleError, match="hides communication.*--max-micro-batches=2"):
        best_afd_plan(model, "H20", "L40S", SearchLimits(tpot_slo_s=1.0, max_micro_batches=2))
    with pytest.raises(ValueError, match="unknown GPU kind 'A100'"):
        best_afd_plan(model, "A100", "L40S", SearchLimits(tpot_slo_s=1.0))
    with pytest.raises(ValueError, match="tpot-slo-ms must be > 0"):
        SearchLimits(tpot_slo_s=0)


def test_fleet_simulation_of_thousands_of_gpus():
    model = MoEModelSpec.from_path(shared_path("configs", "Qwen--Qwen3-30B-A3B"))
    p = best_afd_plan(model, "H20", "L40S", SearchLimits(tpot_slo_s=0.1, max_attention_nodes=128))
    fr = simulate_fleet(p, attention_gpus=3000, ffn_gpus=5000)
    assert fr.replicas == min(3000 // p.attention_gpus, 5000 // p.ffn_gpus) > 0
    assert fr.tokens_per_s == pytest.approx(fr.replicas * p.tokens_per_s)
    assert fr.idle_gpus == 8000 - fr.replicas * p.total_gpus
    with pytest.raises(ValueError, match="FFN pool"):
        simulate_fleet(p, attention_gpus=4096)
    # the fleet objective: most tokens/s from a fixed heterogeneous fleet, at least the per-cost plan's
    lim = SearchLimits(tpot_slo_s=0.1, max_attention_nodes=128, objective="fleet",
                       fleet_attention_gpus=1000, fleet_ffn_gpus=3000)
    best = best_afd_plan(model, "H20", "L40S", lim)
    fb = simulate_fleet(best, 1000, 3000)
    assert fb.tokens_per_s >= simulate_fleet(p, 1000, 3000).tokens_per_s
    assert fb.replicas * best.attention_gpus <= 1000 and fb.replicas * best.ffn_gpus <= 3000
    with pytest.raises(ValueError, match="--objective fleet needs --fleet-gpus"):
        SearchLimits(tpot_slo_s=0.1, objective="fleet")


# ---------------------------------------------------------------- profiles
def _write_profile(tmp_path, model, gpu, k, net=None):
    rng = np.random.default_rng(7)
    noise = lambda n: 1 + rng.uniform(-0.005, 0.005, n)  # noqa: E731 (0.5% measurement noise)
    ba, be = np.array([8, 32, 64, 128, 256]), np.array([32, 128, 512, 1024, 2048])
    prof = {"schema": PROFILE_SCHEMA, "gpu": gpu, "seq_len": 1024, "model": model.to_dict(),
            "attention": {str(tp): [[int(b), float(t)] for b, t in zip(ba, (k[0] * ba + k[1]) / tp * noise(5))]
                          for tp in (1, 2)},
            "expert": {"1": [[int(b), float(t)] for b, t in zip(be, (k[2] * be + k[3]) * noise(5))]}}
    if net:
        prof["network"] = net
    path = tmp_path / f"{gpu}.json"
    path.write_text(json.dumps(prof))
    return str(path)


def test_fit_recovers_known_coefficients_from_a_synthetic_profile(tmp_path):
    model = _table4("DBRX")
    k = (3.1e-6, 41e-6, 0.9e-6, 230e-6)
    sizes = np.array([4e3, 64e3, 1e6, 16e6])
    net = {"bandwidth_gbps": 50, "points": [[float(s), float(s / (50e9 * u))] for s, u in
                                            zip(sizes, [0.05, 0.4, 0.8, 0.95])]}
    path = _write_profile(tmp_path, model, "H20", k, net)
    perf = build_perf_model(model, "H20", "L40S", 1024, tps=(1, 2, 4), profiles=[load_profile(path)])
    c1, c2, c4 = perf.attn.cost(1), perf.attn.cost(2), perf.attn.cost(4)
    assert c1.slope == pytest.approx(k[0], rel=0.02) and c1.intercept == pytest.approx(k[1], rel=0.05)
    assert c2.slope == pytest.approx(k[0] / 2, rel=0.02)
    assert c4.slope == pytest.approx(k[0] / 4, rel=0.02)  # unmeasured tp: scaled from tp=2
    assert perf.attn.util(64e3, 50e9) == pytest.approx(0.4, rel=1e-6)
    assert perf.attn.util(2e5, 50e9) > 0.4 and perf.attn.util(1e9, 50e9) == pytest.approx(0.95)
    assert perf.expert.source == "datasheet"  # the profile is for H20 only
    perf2 = build_perf_model(model, "L40S", "H20", 1024, tps=(1,), profiles=[load_profile(path)])
    assert perf2.expert.cost(1).slope == pytest.approx(k[2], rel=0.02)
    assert perf2.expert.cost(1).intercept == pytest.approx(k[3], rel=0.05)
    line = fit_linear([1, 2, 3], [5, 7, 9])
    assert (line.slope, line.intercept) == pytest.approx((2, 3))
    with pytest.raises(ValueError, match="distinct"):
        fit_linear([4, 4], [1, 2])


def test_profile_for_another_model_is_refused(tmp_path):
    path = _write_profile(tmp_path, _table4("DBRX"), "H20", (1e-6, 1e-5, 1e-6, 1e-5))
    with pytest.raises(ValueError, match="measured for hidden_size=6144"):
        build_perf_model(_table4("Scaled-MoE"), "H20", "H20", 1024, profiles=[load_profile(path)])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "x"}))
    with pytest.raises(ValueError, match="schema"):
        load_profile(str(bad))


def test_node_fit_recovers_k3_k4_k0_and_stays_non_negative():
    k3, k4, k0 = 2e-6, 5e-6, 0.8e-3
    pts = [[g, b, k3 * g * b + g * k4 + k0] for g in (8, 43, 128) for b in (2, 8, 16)]
    c = fit_node_cost(pts)
    assert (c.slope, c.intercept, c.fixed) == pytest.approx((k3, k4, k0), rel=1e-6)
    flat = fit_node_cost([[128, 2, 1.0e-3], [64, 4, 1.1e-3], [43, 16, 1.3e-3]])  # falls as g grows: no g term
    assert min(flat.slope, flat.intercept, flat.fixed) >= 0 and flat.fixed > 0
    for bad in ([[1, 2, 3]], [[0, 1, 1e-3], [1, 1, 1e-3]], [[1, 2], [3, 4]]):
        with pytest.raises(ValueError, match="expert_nodes"):
            fit_node_cost(bad)


def test_expert_nodes_profile_sets_node_time_with_fixed_term(tmp_path):
    model = _table4("DBRX")
    k3, k4, k0 = 1e-6, 20e-6, 0.5e-3
    prof = {"schema": PROFILE_SCHEMA, "gpu": "H200", "model": model.to_dict(),
            "expert_nodes": {"1": [[g, b, k3 * g * b + g * k4 + k0] for g in (1, 4, 8) for b in (4, 32)]},
            "sources": {"note": "ignored by the loader"}}
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(prof))
    perf = build_perf_model(model, "H200", "H200", 1024, tps=(1, 2), profiles=[load_profile(str(path))])
    assert perf.attn.source == "datasheet" and perf.expert.source.startswith("profile:")
    n_a, b_a, g = 2, 64, 4
    _, t_e, _ = perf.micro_batch_times(1, 1, g, n_a, b_a)
    b_e = b_a * n_a * model.top_k / model.num_experts
    assert float(t_e) == pytest.approx(k3 * g * b_e + g * k4 + k0, rel=1e-6)
    c2 = perf.expert.cost(2)  # unmeasured tp: k3, k4 halve, the per-node k0 stays
    assert (c2.slope, c2.intercept, c2.fixed) == pytest.approx((k3 / 2, k4 / 2, k0), rel=1e-6)
    _, t_e_dense, _ = build_perf_model(model, "H200", "H200", 1024, tps=(1,)).micro_batch_times(1, 1, g, n_a, b_a)
    assert float(t_e) != pytest.approx(float(t_e_dense))  # the profile, not the datasheet, set T_e


def test_profiler_on_cpu_feeds_the_plan_cli(tmp_path, capsys):
    cfg = tmp_path / "tiny"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "prof.json"
    assert profiler.main(["--model-path", str(cfg), "--out", str(out), "--gpu", "H20", "--device", "cpu",
                          "--tp", "1,2", "--attn-batch-sizes", "1,8", "--expert-batch-sizes", "4,32",
                          "--seq-len", "16", "--iters", "2", "--dtype", "float32", "--log-level", "error"]) == 0
    prof = load_profile(str(out))
    assert set(prof["attention"]) == {"1", "2"} and all(t > 0 for _, t in prof["expert"]["1"])
    rc = plan_mod.main(["--model-path", str(cfg), "--attention-gpu", "H20", "--ffn-gpu", "H20",
                        "--tpot-slo-ms", "100000", "--max-gpus-per-node", "2", "--avg-seq-len", "16",
                        "--profile", str(out), "--max-attention-nodes", "8", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    p = res[0]["plans"][0]
    assert f"profile:{out}" in p["cost_model"] and p["m"] >= 2 and p["global_batch"] >= 1


def test_cli_prints_plan_and_comparison(capsys):
    path = shared_path("configs", "Qwen--Qwen3-30B-A3B")
    rc = plan_mod.main(["--model-path", path, "--attention-gpu", "H20", "--ffn-gpu", "L40S",
                        "--tpot-slo-ms", "100", "--max-attention-nodes", "64", "--compare-homogeneous",
                        "--fleet-gpus", "4096"])
    text = capsys.readouterr().out
    assert rc == 0
    for needle in ("tp_a=", "n_a=", "tp_e=", "m=", "global batch B=", "per GPU", "per cost",
                   "fleet of 4096 GPUs", "H20/L40S vs H20/H20 per cost"):
        assert needle in text, needle
    rc = plan_mod.main(["--model-path", path, "--attention-gpu", "H20", "--ffn-gpu", "L40S", "--tpot-slo-ms", "0.5"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: no deployment") and "--tpot-slo-ms=0.5" in err
    rc = plan_mod.main(["--model-path", os.path.dirname(path), "--attention-gpu", "H20", "--ffn-gpu", "L40S",
                        "--tpot-slo-ms", "100"])
    assert rc == 2 and "no config.json" in capsys.readouterr().err
