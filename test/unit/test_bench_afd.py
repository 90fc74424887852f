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
    out = bench_afd.main(["--smoke", "--model-path", path, "--results-dir", str(tmp_path)])
    text = out.read_text()
    assert "- hardware: CPU" in text and "- command:" in text and "- date:" in text
    assert "| colocated | 1 |" in text and "| AFD m=2, 1 attention + 2 FFN | 3 |" in text
    assert "m >= 2(1+Tc/Tf) =" in text
    for kb in (32, 512):
        assert f"| {kb} | " in text
    assert "gloo send/recv median us" in text


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
