"""bench_afd.py smoke on CPU: both modes run end to end and write a results file with the date, hardware,
command, the decode table (colocated vs AFD per worker, measured m bound) and the M2N latency table."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conftest import shared_path  # noqa: E402


def test_bench_afd_smoke_writes_both_tables(tmp_path):
    import bench_afd

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

    import bench_afd

    q = queue.Queue()
    q.put({"p2p|32": [1e-5]})
    res, err = bench_afd._collect_sizes(q, time.monotonic() + 0.3)
    assert res == {"p2p|32": [1e-5]} and "time limit" in err
    q.put({"p2p|32": [1e-5]})
    q.put({"error": "rank 1: RuntimeError: boom"})
    res, err = bench_afd._collect_sizes(q, time.monotonic() + 5)
    assert res == {"p2p|32": [1e-5]} and err.startswith("rank 1")
    q.put({"p2p|32": [1e-5]})
    q.put({"done": True})
    assert bench_afd._collect_sizes(q, time.monotonic() + 5) == ({"p2p|32": [1e-5]}, "")
