"""``benchmark.common.timing`` on a GPU: CUDA-event samples are taken (timer ``cuda_event``), ``inner`` divides the
event span, ``time_fn`` picks the events for a CUDA device, and :func:`compare` gives every arm its samples; the
environment probe names the GPU and a record written from it is named after the GPU."""

from __future__ import annotations

import pytest
import torch

from benchmark.common import records, timing

pytestmark = pytest.mark.gpu


def test_cuda_event_timing_and_compare(tmp_path):
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    t = timing.time_fn(lambda: a @ a, device="cuda", iters=5, warmup=2, inner=3)
    assert t.timer == timing.CUDA_EVENT and t.n == 5 and t.inner == 3 and t.median_ms > 0
    out = timing.compare({"mm": lambda: a @ a, "add": lambda: a + a}, device=torch.device("cuda"), rounds=2, iters=3)
    assert {k: (v.n, v.timer) for k, v in out.items()} == {"mm": (6, "cuda_event"), "add": (6, "cuda_event")}
    env = records.environment()
    assert env["gpu"]["count"] >= 1 and env["versions"]["cuda"]
    rec = records.make_record(subject="attention", benchmark="probe", mode="probe", what="timing_probe",
                              rows=[t.summary()], env=env, command="pytest")
    js, _ = records.write_record(rec, tmp_path)
    assert js.stem.endswith(records.gpu_slug(env["gpu"]["model"], env["gpu"]["count"])) and "cpu" not in js.stem
