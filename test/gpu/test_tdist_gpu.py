"""Triton-distributed on GPUs: 2 and 4 ranks as processes (sharing one GPU when there is one; one GPU each
otherwise), the symmetric heap mapped through CUDA IPC. Every primitive (message-passing litmus with
acquire/release, 10,000 signal reuses in one launch, atomics, put/get, barrier_all) and every kernel (AG-GEMM with
the SM and the copy-engine producer, GEMM-RS, all-to-all dispatch + combine) against torch references on random
inputs with uneven and empty segments, plus 100 back-to-back calls (buffer reuse without host barriers).

The ranks run the cases in one group per world size (cases in tdist_gpu_case.py), fail closed and informative:
* device waits are bounded (TDIST_WAIT_TIMEOUT_S, default 30 s): a wait that gives up aborts the group on the device
  and its rank raises TdistWaitError naming kernel, rank and signal;
* every case's outcome is appended to TDIST_RESULTS (a JSON-lines file; default: none) the moment all ranks reported
  it, so a later hang or timeout keeps the earlier results;
* when a case raises on any rank the group stops and the remaining cases run in a fresh group; a group that sends
  nothing for TDIST_STALL_S seconds (default 150) or runs past TDIST_GPU_TIMEOUT (default 900) is killed, the case
  it was in is reported with each rank's last progress note, and the cases after it run in a fresh group;
* TDIST_CASES=case_a,case_b runs only those cases (e.g. TDIST_CASES=case_gemm_rs).
Multicast stays off (the environment below, inherited by the ranks).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

from sglang.srt.utils.nvls_env import NVLS_OFF_ENV, apply_nvls_off_env  # noqa: E402

apply_nvls_off_env(os.environ)
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(HERE), str(REPO / "test")):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"), str(HERE),
                                            os.environ.get("PYTHONPATH", "")])
from conftest import gpu_tiered  # noqa: E402

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

# The case names are read from the source, not imported: importing triton here at collection would fix its
# (non-interpreted) mode for the CPU interpreter tests that run later in the same pytest process.
_CASE_SRC = (HERE / "tdist_gpu_case.py").read_text()
CASES = next(ast.literal_eval(n.value) for n in ast.parse(_CASE_SRC).body
             if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "CASES")

_SELECTED = [c.strip() for c in os.environ.get("TDIST_CASES", "").split(",") if c.strip()]
_UNKNOWN = [c for c in _SELECTED if c not in CASES]
if _SELECTED:
    CASES = _SELECTED  # an unknown name fails its test (and test_case_selection_is_valid)
_RESULTS = {}


def _write(line: dict) -> None:
    path = os.environ.get("TDIST_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()


def _group(world):
    """{case: {rank: outcome}} and problems for ``world`` ranks; groups are restarted after a stop or a hang."""
    if world in _RESULTS:
        return _RESULTS[world]
    os.environ.pop("TRITON_INTERPRET", None)  # real kernels (the CPU tests may have set the interpreter)
    import tdist_gpu_case as C
    from sgl_kernel.tdist.layout import HeapConfig
    from sgl_kernel.tdist.spawn import run_ranks

    group_timeout = float(os.environ.get("TDIST_GPU_TIMEOUT", "900"))
    stall = float(os.environ.get("TDIST_STALL_S", "150"))
    cfg = HeapConfig(data_bytes=192 << 20, signal_slots=4096,
                     wait_timeout_s=float(os.environ.get("TDIST_WAIT_TIMEOUT_S", "30")))
    outcomes, problems = {}, {}
    t_end = time.time() + group_timeout

    def on_result(rank, case, out):
        outcomes.setdefault(case, {})[rank] = out
        if len(outcomes[case]) == world:
            o = outcomes[case]
            _write({"world": world, "case": case, "ok": not any(o[r]["fails"] for r in o),
                    "seconds": max(o[r]["seconds"] for r in o), "failures": {r: o[r]["fails"] for r in o if
                                                                             o[r]["fails"]}})

    todo = list(CASES)
    while todo and time.time() < t_end - 10:
        results, probs = run_ranks(world, C.run_all, (todo,), env=NVLS_OFF_ENV, timeout=t_end - time.time(),
                                   heap_config=cfg,
                                   on_result=on_result, stall_timeout=stall, gloo_timeout=max(30.0, stall / 2))
        done = [c for c in todo if len(outcomes.get(c, {})) == world]
        nxt = [c for c in todo if c not in done]
        if nxt and probs:  # the group died in nxt[0] (no complete outcome): blame it, go on with the rest
            problems[nxt[0]] = probs
            _write({"world": world, "case": nxt[0], "ok": False, "problems": probs,
                    "partial": {r: o for r, o in outcomes.get(nxt[0], {}).items()}})
            nxt = nxt[1:]
        elif nxt and len(nxt) == len(todo):  # no progress and no problem: do not loop
            problems[nxt[0]] = ["group ended without running it"]
            nxt = nxt[1:]
        for r, res in enumerate(results):
            if res:
                print(f"world {world} rank {r} case seconds: {res['_time']}" +
                      (f" (stopped: {res['_stopped']})" if "_stopped" in res else ""))
        todo = nxt
    for c in todo:
        problems.setdefault(c, []).append("not run: the world's time budget (TDIST_GPU_TIMEOUT) ran out")
    _RESULTS[world] = (outcomes, problems)
    return _RESULTS[world]


@pytest.mark.gpu
def test_case_selection_is_valid():
    assert not _UNKNOWN, f"TDIST_CASES names unknown cases {_UNKNOWN}; known: {CASES}"


@pytest.mark.parametrize("world", gpu_tiered([2, 4]))  # every case in one group of 2 ranks is the smoke test
@pytest.mark.parametrize("case", CASES)
def test_tdist_case(world, case):
    outcomes, problems = _group(world)
    got = outcomes.get(case, {})
    msgs = [f"rank {r}: " + "; ".join(got[r]["fails"]) for r in sorted(got) if got[r]["fails"]]
    missing = [r for r in range(world) if r not in got]
    if missing:
        msgs.append(f"ranks {missing} did not report {case}")
    if case in problems:
        msgs.append("group problems: " + " | ".join(problems[case]))
    assert not msgs, f"world {world} {case}: " + "\n".join(msgs)


def _sp_greedy(ps, path, prompt, steps, tdist):
    """Rank body (tp_worker.spawn_ranks): greedy tokens + first logits with the sequence-parallel executor on the
    Triton-distributed ops of producer ``tdist`` ("decomp", "ce" or "sm") or the plain forward (tdist "")."""
    import torch

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.communicator import create_communicator
    from sglang.srt.model_loader.loader import load_model
    from sglang.srt.model_executor.executors.sequence_parallel import SequenceParallelExecutor
    from tp_worker import harness_for

    config = ModelConfig.from_path(path, None, "float32", "cuda")
    model = load_model(config, "auto", "cuda", tp_rank=ps.tp_rank, tp_size=ps.tp_size,
                       comm=create_communicator(ps, "auto"))
    ex = None
    if tdist:
        from sglang.srt.distributed.tdist_overlap import TdistSequenceParallelOps

        from sgl_kernel.tdist.auto import CalibrationTable

        # default_min_m=1: the decomposition on every call (the NCCL fallback is covered by the auto case)
        ops = TdistSequenceParallelOps(ps.cpu_group, ps.torch_device(), ps.tp_rank, ps.tp_size, max_tokens=256,
                                       heap_bytes=64 << 20, gather_group=ps.device_group, producer=tdist,
                                       table=CalibrationTable(default_min_m=1))
        ex = SequenceParallelExecutor(ops)
    h = harness_for(model, config, ps.tp_size, device="cuda")
    out, first, new = [], None, list(prompt)
    for _ in range(steps):
        logits = h.run(h.prepare([("r", new)]), ex)[0].float().cpu()
        first = logits if first is None else first
        tok = int(logits.argmax())
        out.append(tok)
        new = [tok]
    torch.cuda.synchronize()
    return out, first


@pytest.mark.gpu_extended
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_executor_with_tdist_equals_single_process(world):
    _check_sp_greedy(world, "ce", share_gpu=True)


@pytest.mark.parametrize("producer", gpu_tiered(["decomp", "sm"]))
def test_sequence_parallel_executor_one_rank_per_gpu_equals_single_process(producer):
    """--enable-tdist-overlap's default path (the decomposition behind AutoAgGemm / AutoGemmRs) and the Triton SM
    kernels with one rank per GPU (NCCL device group, CUDA IPC across GPUs): greedy tokens of stories260K equal the
    single process's, first-step logits to 1e-3."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check_sp_greedy(2, producer, share_gpu=False)


def _check_sp_greedy(world, producer, share_gpu):
    """--enable-tdist-overlap's executor on the fused AG-GEMM / GEMM-RS (fp32, IEEE products; ranks sharing the
    GPU): greedy tokens of stories260K equal the single process's, first-step logits to 1e-3."""
    import torch

    sys.path.insert(0, str(REPO / "test" / "unit"))
    from conftest import shared_path
    from tp_worker import spawn_ranks

    path = shared_path("models", "stories260K")
    prompt = [1, 403, 407, 261, 378, 300, 305, 290, 411]
    (want, want_logits), = spawn_ranks(_sp_greedy, 1, path, prompt, 12, "", device="cuda", share_gpu=True,
                                       timeout=300)
    for rank, (got, logits) in enumerate(spawn_ranks(_sp_greedy, world, path, prompt, 12, producer, device="cuda",
                                                     share_gpu=share_gpu, timeout=400)):
        assert got == want, f"tp{world} rank {rank}: {got} != single process {want}"
        torch.testing.assert_close(logits, want_logits, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu_extended
def test_server_tp2_shared_gpu_tdist_overlap_equals_tp1():
    """Through HTTP: ``--tp 2 --tp-ranks-share-gpu --enable-tdist-overlap`` on the real stories260K checkpoint (fp32
    on the GPU: the heap over CUDA IPC within the device, fused AG-GEMM / GEMM-RS with IEEE products) gives TP=1's
    greedy tokens."""
    sys.path.insert(0, str(REPO / "test"))
    from conftest import shared_path
    from server_utils import ServerProcess

    import requests

    model = shared_path("models", "stories260K")
    prompts = ["Once upon a time, there was a little girl named Lily. She loved to play with her toys",
               "The cat sat on the mat and looked at the dog. The dog was big and brown and"]
    common = ["--model-path", model, "--device", "cuda", "--dtype", "float32", "--max-total-tokens", "4096",
              "--mem-fraction-static", "0.2"]
    outs = {}
    # --tdist-overlap-min-tokens 0: these short batches would run the sequential executor by default
    tdist = ["--tp", "2", "--tp-ranks-share-gpu", "--enable-tdist-overlap", "--tdist-overlap-min-tokens", "0"]
    for name, extra in (("tp1", []), ("tdist", tdist)):
        with ServerProcess(common + extra) as srv:
            r = requests.post(f"{srv.url}/generate", json={
                "text": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 24}}, timeout=120)
            assert r.status_code == 200, r.text
            outs[name] = [o["output_ids"] for o in r.json()]
            if name == "tdist":  # the fused path must really have been chosen (not the logged torch fallback)
                with open(srv.log_path) as f:
                    log = f.read()
                assert "Triton-distributed AG-GEMM / GEMM-RS" in log and "tdist overlap unavailable" not in log, \
                    srv.log_tail()
                assert "sequence-parallel layout for forwards of >= 0 tokens" in log, srv.log_tail()
    assert outs["tdist"] == outs["tp1"]
