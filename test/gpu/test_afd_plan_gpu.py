"""AFD planner / load balancer on a GPU: a real profile feeds the plan; router counting and token
assignment on CUDA equal the CPU results."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import shared_path
from sglang.srt.afd.planner import plan as plan_mod
from sglang.srt.afd.planner import profiler
from sglang.srt.afd.load_balance import ExpertLoadCollector, assign_tokens, greedy_placement
from sglang.srt.afd.planner.perf_model import load_profile

pytestmark = pytest.mark.gpu


def test_profile_on_this_gpu_feeds_the_plan(tmp_path, capsys):
    cfg = shared_path("configs", "mistralai--Mixtral-8x7B-v0.1")
    name = torch.cuda.get_device_name().upper()
    gpu = next((k for k in ("H200", "H100", "H800", "H20", "L40S") if k in name), "H100")
    out = tmp_path / "prof.json"
    assert profiler.main(["--model-path", cfg, "--out", str(out), "--gpu", gpu, "--tp", "1,2,4,8",
                          "--iters", "10", "--log-level", "error"]) == 0
    prof = load_profile(str(out))
    for role in ("attention", "expert"):
        for tp, pts in prof[role].items():
            xs, ts = zip(*pts)
            # more tokens never take clearly less; small shards are launch-bound (attention at TP 8 measured
            # 0.119 ms at 8 tokens and 0.116 ms at 256 on an H100), so equal within 10% is allowed
            assert all(t > 0 for t in ts) and ts[-1] >= 0.9 * ts[0], (role, tp, pts)
    rc = plan_mod.main(["--model-path", cfg, "--attention-gpu", gpu, "--ffn-gpu", gpu, "--tpot-slo-ms", "150",
                        "--profile", str(out), "--json"])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)[0]["plans"][0]
    assert f"profile:{out}" in plan["cost_model"] and plan["m"] >= 3
    print(json.dumps(plan, indent=1))


def test_router_counting_and_assignment_on_cuda_equal_cpu():
    g = torch.Generator().manual_seed(0)
    probs = torch.arange(1, 65, dtype=torch.float64) ** -1.2
    ids = torch.multinomial(probs.expand(4096, -1), 4, replacement=False, generator=g)
    cpu, gpu = ExpertLoadCollector(64), ExpertLoadCollector(64)
    cpu.record(ids)
    gpu.record(ids.cuda())
    np.testing.assert_array_equal(cpu.counts(), gpu.counts())
    placement = greedy_placement(cpu.counts()[0], 8, 8)
    w_cpu, r_cpu = assign_tokens(ids, placement)
    w_gpu, r_gpu = assign_tokens(ids.cuda(), placement)
    assert w_gpu.is_cuda and torch.equal(w_gpu.cpu(), w_cpu) and torch.equal(r_gpu.cpu(), r_cpu)
