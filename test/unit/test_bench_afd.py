"""benchmark/afd/bench.py smoke on CPU: both modes run end to end and write a results file with the date, hardware,
command, the decode table (colocated vs AFD per worker, measured m bound) and the M2N latency table."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conftest import shared_path  # noqa: E402


def test_bench_afd_smoke_writes_both_tables(tmp_path):
    from benchmark.afd import bench as bench_afd

    path = shared_path("models", "stories260K-moe")
    out = bench_afd.main(["--smoke", "--model-path", path, "--results-dir", str(tmp_path), "--record-dir",
                          str(tmp_path / "rec")])
    text = out.read_text()
    from benchmark.common.records import load_record

    (rec,) = [load_record(f) for f in (tmp_path / "rec" / "afd").glob("*_afd_decode_smoke_cpu.json")]
    assert {r["setup"] for r in rec["rows"]} == {"colocated", "afd"} and rec["headline"][0]["ratio"] is not None
    (m2n,) = [load_record(f) for f in (tmp_path / "rec" / "afd").glob("*_afd_m2n_smoke_cpu.json")]
    assert m2n["mode"] == "m2n" and {r["kb"] for r in m2n["rows"]} == {32, 512}
    assert all(r["transport"] == "inline" and r["baseline"] == "gloo send/recv (eager)" for r in m2n["rows"])
    assert all(r["vs_baseline"] == round(r["median_us"] / r["baseline_median_us"], 3) for r in m2n["rows"])
    assert "- hardware: CPU" in text and "- command:" in text and "- date:" in text
    assert "| colocated | 1 |" in text and "| AFD m=2, 1 attention + 2 FFN | 3 |" in text
    assert "m >= 2(1+Tc/Tf) =" in text
    for kb in (32, 512):
        assert f"| {kb} | " in text
    assert "gloo send/recv median us" in text


def test_decode_record_carries_baseline_ratio_headline(tmp_path):
    """--record-dir: one row per setup / m / batch, colocated tok/s per GPU of the same batch as the baseline, the
    per-GPU ratio, the memory floor, and the best AFD vs best colocated per GPU as the headline."""
    from types import SimpleNamespace

    from benchmark.afd.decode_throughput import decode_record
    from benchmark.common import records

    res = {"colocated": {"rows": {64: {"step_s": 0.01, "tps": 6400.0, "floor_s": 0.005},
                                  128: {"step_s": 0.016, "tps": 8000.0, "floor_s": 0.006}}},
           "afd": {"attention_workers": 1, "ffn_workers": 2,
                   "rows": {(2, 64): {"step_s": 0.005, "tps": 12800.0, "floor_s": 0.004},
                            (2, 128): {"step_s": 0.008, "tps": 16000.0, "floor_s": 0.004}}}}
    a = SimpleNamespace(model_path="m", load_format="dummy", device="cuda", batch=[64, 128], input_len=32, steps=32,
                        ffn_workers=2, attention_workers=1, micro_batches=[2], smoke=False)
    env = {"git_commit": "abc", "git_dirty": False, "date": "2026-12-07T00:00:00+00:00",
           "gpu": {"model": "NVIDIA H100 80GB HBM3", "count": 8, "driver": None}, "versions": {"python": "3"}}
    js, _ = records.write_record(decode_record(a, res, env=env, command="python benchmark/afd/bench.py"), tmp_path)
    rec = records.load_record(js)
    assert js.name == "2026-12-07_afd_decode_3xh100.json" and rec["baselines"] == ["colocated_tok_s_per_gpu"]
    afd64 = rec["rows"][2]
    assert (afd64["setup"], afd64["m"], afd64["gpus"], afd64["colocated_tok_s_per_gpu"]) == ("afd", 2, 3, 6400.0)
    assert afd64["per_gpu_ratio"] == round(12800 / 3 / 6400, 3) and afd64["step_over_floor"] == 1.25
    (h,) = rec["headline"]
    assert (h["value"], h["baseline"], h["ratio"]) == (5333.3, 8000.0, round(16000 / 3 / 8000, 3))


def test_m2n_record_rows_baseline_ratio_headline(tmp_path):
    """--record-dir for --mode m2n: one row per size / transport / eager or graphed with the one-way medians of M2N
    and of the same-run send/recv, their ratio and the copy-engine floor; the markdown table is unchanged by it; the
    headline is the best graphed row at the smallest and the largest size (a graphed row whose baseline fell back to
    the eager one is not a headline)."""
    from types import SimpleNamespace

    from benchmark.afd.m2n_latency import m2n_record, m2n_table
    from benchmark.common import records

    res = {"cuda_push-dev|32": [12e-6, 13e-6, 14e-6], "p2p|32": [20e-6, 22e-6, 24e-6],
           "cuda_push-dev@graph|32": [5.0e-6, 5.2e-6, 5.4e-6], "p2p@graph|32": [14e-6, 14.5e-6, 15e-6],
           "rawll@graph|32": [4.0e-6, 4.1e-6], "floor|32": 2.5e-6,
           "cuda_push-dev|512": [30e-6, 31e-6], "p2p|512": [40e-6, 41e-6],
           "cuda_push-dev@graph|512": [9e-6, 9.5e-6], "p2p@graph|512": "capture failed on rank 1: RuntimeError: x",
           "cuda_ipc|32": [16e-6], "cuda_ipc|512": "capture failed on rank 0: boom"}
    a = SimpleNamespace(device="cuda", transports=["cuda_push-dev", "cuda_ipc"], sizes_kb=[32, 512], iters=200,
                        warmup=10, graph_k=20, graph_replays=20, smoke=False)
    lines, rows = m2n_table(a, res)
    assert "| 32 | cuda_push-dev (eager) | 13.0 | 14.0 | 22.0 | 24.0 | 0.59x | not met |" in lines
    assert any(x.startswith("| 512 | cuda_ipc (eager) | capture failed on rank 0: boom |") for x in lines)
    env = {"git_commit": "abc", "git_dirty": False, "date": "2026-12-07T00:00:00+00:00",
           "gpu": {"model": "NVIDIA H100 80GB HBM3", "count": 8, "driver": None}, "versions": {"python": "3"}}
    rec = m2n_record(a, rows, gpu_count=2, env=env, command="python benchmark/afd/bench.py --mode m2n")
    js, md = records.write_record(rec, tmp_path)
    rec = records.load_record(js)
    assert js.name == "2026-12-07_afd_m2n_2xh100.json" and rec["mode"] == "m2n"
    assert rec["baselines"] == ["baseline_median_us"] and rec["floor"]["column"] == "copy_floor_us"
    eager32 = rec["rows"][0]
    assert (eager32["kb"], eager32["transport"], eager32["timing"]) == (32, "cuda_push-dev", "eager")
    assert eager32["median_us"] == pytest.approx(13.0) and eager32["baseline_median_us"] == pytest.approx(22.0)
    assert eager32["vs_baseline"] == round(13.0 / 22.0, 3) and eager32["copy_floor_us"] == pytest.approx(2.5)
    by = {(r["kb"], r["transport"], r["timing"]): r for r in rec["rows"]}
    assert by[(32, "raw LL floor", "graph")]["vs_baseline"] == round(4.05 / 14.5, 3)
    fell_back = by[(512, "cuda_push-dev", "graph")]
    assert fell_back["baseline"] == "NCCL send/recv (eager)" and fell_back["baseline_fallback"].startswith("capture")
    assert by[(512, "cuda_ipc", "eager")]["error"] == "capture failed on rank 0: boom"
    assert by[(512, "cuda_ipc", "eager")]["vs_baseline"] is None
    h32, h512 = rec["headline"]
    assert (h32["value"], h32["baseline"], h32["ratio"]) == (5.2, 14.5, round(5.2 / 14.5, 3))
    assert "cuda_push-dev (graph)" in h32["label"] and "512 KB" in h512["label"]
    assert h512["ratio"] == round(30.5 / 40.5, 3)  # the eager row: the graphed one has no graphed baseline
    assert "| kb | transport |" in md.read_text() and records.render_markdown(rec).startswith("# benchmark.afd.bench")


def test_m2n_collect_keeps_finished_sizes_on_timeout_and_error():
    """A cut-short M2N run keeps the sizes rank 0 finished (the table marks the run [partial]), and reports why."""
    import queue
    import time

    from benchmark.afd import m2n_latency as afd_m2n

    q = queue.Queue()
    q.put({"p2p|32": [1e-5]})
    res, err = afd_m2n._collect_sizes(q, time.monotonic() + 0.3)
    assert res == {"p2p|32": [1e-5]} and "time limit" in err
    q.put({"p2p|32": [1e-5]})
    q.put({"error": "rank 1: RuntimeError: boom"})
    res, err = afd_m2n._collect_sizes(q, time.monotonic() + 5)
    assert res == {"p2p|32": [1e-5]} and err.startswith("rank 1")
    q.put({"p2p|32": [1e-5]})
    q.put({"done": True})
    assert afd_m2n._collect_sizes(q, time.monotonic() + 5) == ({"p2p|32": [1e-5]}, "")


def test_bench_afd_data_parallel_attention_and_uneven_ffn(tmp_path):
    """2 attention processes (data parallel) x 3 FFN processes (experts 2/1/1 of 4): the table names the layout and
    the 5 GPUs, every role logs its parameter and KV bytes (FFN: 0 KV), and the pipeline check is printed."""
    from benchmark.afd import bench as bench_afd

    path = shared_path("models", "stories260K-moe")
    out = bench_afd.main(["--smoke", "--mode", "decode", "--setups", "afd", "--attention-workers", "2",
                          "--ffn-workers", "3", "--model-path", path, "--results-dir", str(tmp_path),
                          "--timeout", "240"])
    text = out.read_text()
    assert "| AFD m=2, 2 attention + 3 FFN | 5 | 4 |" in text
    for i in (0, 1):
        assert f"- role attention (worker {i}, cpu) holds " in text
    kv = [int(x.split(" KV bytes")[0].rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("- role attention")]
    assert len(kv) == 2 and min(kv) > 0
    ffn = [x for x in text.splitlines() if x.startswith("- role ffn")]
    assert len(ffn) == 3 and all(x.endswith("and 0 KV bytes (0.00 GiB)") for x in ffn)
    expert = [int(x.split(" holds ")[1].split(" ")[0]) for x in ffn]
    assert expert[0] == 2 * expert[1] == 2 * expert[2] > 0  # 4 experts over 3 workers: 2 / 1 / 1
    assert "m >= 2(1+Tc/Tf) =" in text


def test_bench_afd_start_failure_is_reported_at_once(tmp_path):
    """A layout that cannot start (here: 5 FFN workers for 4 experts; on a GPU e.g. CUDA out of memory) fails the AFD
    measurement with the error naming the value, well before --timeout (no silent wait for a dead worker)."""
    import time

    import pytest

    from benchmark.afd import bench as bench_afd

    path = shared_path("models", "stories260K-moe")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ValueError: num_workers=5 must be in \[1, num_experts=4\]"):
        bench_afd.main(["--smoke", "--mode", "decode", "--setups", "afd", "--ffn-workers", "5", "--model-path", path,
                        "--results-dir", str(tmp_path), "--timeout", "400"])
    assert time.monotonic() - t0 < 300
