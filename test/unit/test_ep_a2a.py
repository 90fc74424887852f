"""Expert parallelism by all-to-all (``--moe-a2a-backend nccl|tdist``) on CPU: gloo, one rank per process, one
process group per world size running every backend and mode.

* Property: for seeded random routings (uneven token counts, every token on one rank, ranks that send or receive
  nothing, full low-latency capacity), dispatch -> local experts -> combine equals the all-reduce expert parallelism
  of ``layers/moe/fused_moe.py`` (FusedMoE's partial sums, all-reduced) in both modes, both backends (tdist also in
  several normal-mode rounds), fp32 and bf16, at EP 2 and 4; the handles' rows are grouped by local expert with the
  right counts and exactly the (expert, weight, token) pairs routed to the rank.
* Model: ``stories260K-moe8`` (8 different experts) at EP = TP = 2 and 4 gives TP1's greedy tokens for the shared
  prompts, with requests joining mid-decode (mixed prefill + decode batches): nccl through the model's forward (EP 2
  and 4) and through request micro-batches (EP 2), 32 tokens; tdist through the forward (32 tokens at EP 2, 8 at EP
  4: the Triton interpreter runs every all-to-all kernel phase on the CPU); decode batches use the low-latency mode,
  prefill and mixed batches the normal mode. A dispatch to the wrong experts changes the tokens (negative control).
* Big configs: Qwen3-30B-A3B (tdist) and Mixtral-8x7B (nccl) with every size real but one decoder layer (CPU
  memory), dummy bf16 weights (expert down projections scaled so the experts dominate), EP 2: prefill, a mixed step
  and decode steps give finite logits equal to the all-reduce EP's on the same weights (within bf16 rounding), and
  a wrong dispatch does not.

tdist runs the real Triton kernels under ``TRITON_INTERPRET=1`` over a host shared-memory symmetric heap
(``sgl_kernel.tdist.host_heap``); without triton its cases are skipped with that reason.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from conftest import shared_path  # noqa: E402
from ep_a2a_worker import tp1_greedy_tokens  # noqa: E402
from tp_worker import spawn_ranks  # noqa: E402

MODEL = shared_path("models", "stories260K-moe8")
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a bird"]
N_NEW = 32
HAS_TRITON = importlib.util.find_spec("triton") is not None
FP32_ATOL, BF16_ATOL = 2e-5, 3e-2
BIG = {"qwen3_moe": (shared_path("configs", "Qwen--Qwen3-30B-A3B"), "tdist"),
       "mixtral": (shared_path("configs", "mistralai--Mixtral-8x7B-v0.1"), "nccl")}


def _plan(world: int) -> dict:
    tdist = ["tdist"] if HAS_TRITON else []
    prop_backends = ["nccl"] + (["tdist", "tdist:3"] if HAS_TRITON and world == 2 else tdist)
    plan = {"property": dict(backends=prop_backends, seeds=[0], dtypes=("float32", "bfloat16") if world == 2
                             else ("float32",))}
    if os.path.isdir(MODEL):
        prompts = _prompt_ids()
        jobs = ["nccl/forward"] + (["nccl/micro_batch"] + (["tdist/forward"] if HAS_TRITON else [])
                                   if world == 2 else [])
        plan["model"] = dict(path=MODEL, prompts=prompts, jobs=jobs, n_new=N_NEW)
        if HAS_TRITON and world == 4:
            plan["model_short"] = dict(path=MODEL, prompts=prompts, jobs=["tdist/forward"], n_new=8,
                                       negative_control=False)
    big = [(name, d, 1, b if HAS_TRITON else "nccl") for name, (d, b) in BIG.items() if os.path.isdir(d)]
    if world == 2 and big:
        tmp = tempfile.mkdtemp(prefix="ep-a2a-configs-")
        atexit.register(shutil.rmtree, tmp, True)
        plan["big"] = dict(jobs=big, tmp=tmp)
    return plan


@functools.lru_cache(maxsize=None)
def _prompt_ids() -> list:
    from sglang.srt.utils.common import get_tokenizer

    tok = get_tokenizer(MODEL)
    return [list(tok.encode(p)) for p in PROMPTS]


@functools.lru_cache(maxsize=None)
def _world(world: int) -> list:
    """Every rank's results of the one process group of ``world`` ranks."""
    return spawn_ranks(__import__("ep_a2a_worker").ep_world, world, _plan(world), ep_size=world, timeout=900)


@functools.lru_cache(maxsize=None)
def _tp1() -> list:
    return [tp1_greedy_tokens(MODEL, p, N_NEW) for p in _prompt_ids()]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_equals_allreduce_ep(world):
    results = _world(world)
    names = {c["name"] for c in results[0]["property"]}
    for backend in ("nccl",) + (("tdist",) if HAS_TRITON else ()):
        for mode in ("normal", "low_latency"):
            assert any(n.startswith(f"{backend}/") and f"/{mode}/" in n for n in names), (backend, mode)
    assert any(n.startswith("tdist:3/") for n in names) or not HAS_TRITON or world != 2
    for rank, per_rank in enumerate(results):
        for c in per_rank["property"]:
            assert c["invariants"] is None, (rank, c["name"], c["invariants"])
            atol = FP32_ATOL if "/float32/" in c["name"] else BF16_ATOL
            assert c["err"] <= atol, (rank, c["name"], c["err"])
    if not HAS_TRITON:
        pytest.skip("triton is not installed: the tdist backend's cases did not run (nccl passed)")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_stories_moe8_greedy_equals_tp1(world):
    if not os.path.isdir(MODEL):
        pytest.skip(f"{MODEL} is not present (shared test data)")
    want = _tp1()
    results = _world(world)
    model = dict(results[0]["model"])
    model.update(results[0].get("model_short", {}))
    for job, got in model.items():
        if job == "rotated_experts":
            continue
        n = len(got["tokens"][0])
        assert got["tokens"] == [w[:n] for w in want], (world, job)
        assert all(r["model"].get(job, r.get("model_short", {}).get(job))["tokens"] == got["tokens"]
                   for r in results), (world, job, "ranks disagree")
        assert {"EXTEND", "MIXED", "DECODE"} <= set(got["modes"]), (job, got["modes"])
        assert got["calls"]["normal"] > 0 and got["calls"]["low_latency"] > 0, (job, got["calls"])
    assert "nccl/forward" in model and ("nccl/micro_batch" in model or world != 2)
    assert (world == 4 or not HAS_TRITON) or "tdist/forward" in model
    bad = model["rotated_experts"]["tokens"]
    assert any(b != w[:len(b)] for b, w in zip(bad, want)), "a wrong dispatch must change the tokens"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BIG))
def test_big_moe_config_ep2_matches_allreduce_ep(name):
    if not os.path.isdir(BIG[name][0]):
        pytest.skip(f"{BIG[name][0]} is not present (shared test data)")
    for rank, per_rank in enumerate(_world(2)):
        r = per_rank["big"][name]
        assert r["finite"] and r["blocks"] == 1, (rank, r)
        assert r["calls"]["normal"] > 0 and r["calls"]["low_latency"] > 0, (rank, r)
        assert r["diff"] <= 0.02 * r["scale"], (rank, name, r)
        assert r["wrong_diff"] > max(10 * r["diff"], 0.05 * r["scale"]), (rank, name, r,
                                                                           "a wrong dispatch must change the logits")
