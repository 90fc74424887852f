"""benchmark/afd/bench.py smoke on CPU: both modes run end to end and write a results file with the date, hardware,
command, the decode table (colocated vs AFD per worker, measured m bound) and the M2N latency table."""

from __future__ import annotations

import os
import sys

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
