"""The WorkerLauncher protocol (multiprocessing implementation): explicit devices, the NVLS-off environment,
liveness that survives a SIGKILLed launcher without os.getppid(), process groups by role, TCP sockets."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import launcher_helpers  # noqa: E402

from sglang.srt.entrypoints.worker_launcher import (  # noqa: E402
    MultiprocessingLauncher, PipeParentWatch, ProcessSpec,
)
from sglang.srt.deployment import worker_device  # noqa: E402
from sglang.srt.server_args import PortArgs, ServerArgs  # noqa: E402


def _wait_file(path, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            time.sleep(0.05)
            return open(path).read()
        time.sleep(0.05)
    raise TimeoutError(path)


def test_worker_device_is_explicit():
    assert [worker_device("cuda", i, base_gpu_id=2, gpu_id_step=2) for i in range(3)] == ["cuda:2", "cuda:4", "cuda:6"]
    assert worker_device("cpu", 5) == "cpu"
    with pytest.raises(ValueError, match="gpu_id_step"):
        worker_device("cuda", 0, gpu_id_step=0)
    with pytest.raises(ValueError, match="base-gpu-id"):
        ServerArgs(base_gpu_id=-1)
    with pytest.raises(ValueError, match="zmq-transport"):
        ServerArgs(zmq_transport="udp")


def test_launch_passes_env_and_device(tmp_path):
    launcher = MultiprocessingLauncher()
    out = str(tmp_path / "w.json")
    h = launcher.launch(ProcessSpec(name="w", target=launcher_helpers.record_env, args=(out, "cuda:3"), device="cuda:3",
                                   env={"SGLANG_TEST_EXTRA": "x"}))
    h.join(60)
    assert h.exitcode == 0
    got = json.loads(open(out).read())
    assert got["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                          "SGLANG_TEST_EXTRA": "x"}
    assert got["device"] == "cuda:3" and got["pid"] == h.pid and got["alive"] is True


def test_worker_exits_when_its_launcher_is_sigkilled(tmp_path):
    """No os.getppid(): the launcher dies by SIGKILL (no cleanup runs), the pipe closes, the worker leaves."""
    out = str(tmp_path / "grandchild.pid")
    middle = mp.get_context("spawn").Process(target=launcher_helpers.middle_launcher, args=(out,))
    middle.start()
    try:
        pid = int(_wait_file(out))
        time.sleep(0.5)
        os.kill(pid, 0)  # alive while the launcher lives
        os.kill(middle.pid, signal.SIGKILL)
        middle.join(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            try:  # reap if it became our child's zombie (it is re-parented to init or a subreaper)
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the worker outlived its SIGKILLed launcher by 20 s")
    finally:
        if middle.is_alive():
            middle.kill()


def test_pipe_watch_sees_closed_writer():
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    watch = PipeParentWatch(reader)
    assert watch.parent_alive()
    writer.close()
    assert not watch.parent_alive() and not watch.parent_alive()


def test_process_groups_by_role(tmp_path):
    """Two roles of two ranks each: collectives stay inside a role; tp_rank/tp_size are role-local."""
    from sglang.srt.utils.common import free_tcp_ports

    port = free_tcp_ports(1)[0]  # below the ephemeral range: no connect() of a parallel test worker takes it
    roles = [("attention", [0, 1]), ("ffn", [2, 3])]
    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"r{r}.json") for r in range(4)]
    procs = [ctx.Process(target=launcher_helpers.role_allreduce, args=(r, f"tcp://127.0.0.1:{port}", roles, outs[r]))
             for r in range(4)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0] * 4
        got = [json.loads(open(o).read()) for o in outs]
        assert [(g["role"], g["tp_rank"], g["tp_size"], g["sum"]) for g in got] == [
            ("attention", 0, 2, 3.0), ("attention", 1, 2, 3.0), ("ffn", 0, 2, 7.0), ("ffn", 1, 2, 7.0)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def test_role_layout_validation():
    from sglang.srt.distributed.parallel_state import init_role_parallel_state

    with pytest.raises(ValueError, match="partition"):
        init_role_parallel_state(0, [("a", [0, 2])], "tcp://127.0.0.1:1")


def test_port_args_tcp():
    pa = PortArgs.init_new("tcp")
    eps = [pa.tokenizer_ipc, pa.scheduler_input_ipc, pa.detokenizer_ipc]
    assert all(e.startswith("tcp://127.0.0.1:") for e in eps) and len(set(eps)) == 3 and pa.ipc_dir == ""
    with pytest.raises(ValueError, match="transport"):
        PortArgs.init_new("udp")


def test_wait_ready_reports_the_first_failure_by_name():
    from types import SimpleNamespace

    from sglang.srt.deployment.plan import WorkerRole, WorkerSpec
    from sglang.srt.entrypoints.launch import _wait_ready

    def proc(alive=True, code=None):
        return SimpleNamespace(is_alive=lambda: alive, exitcode=code)

    def pipe(*msgs):
        r, w = mp.Pipe(duplex=False)
        for m in msgs:
            w.send(m)
        if not msgs:
            w.close()  # EOF: the worker died before answering
        return r, w

    sched = [WorkerSpec(WorkerRole.AGGREGATED, f"s{r}", rank=r, tp_size=2, index=r) for r in range(2)]
    ffn = WorkerSpec(WorkerRole.FFN, "f0", rank=0, index=2)
    ready = {"status": "ready", "tp_rank": 0, "max_total_tokens": 7}
    later = time.monotonic() + 5
    (r0, w0), (r1, w1) = pipe(ready), pipe(dict(ready, tp_rank=1))
    procs = SimpleNamespace(workers=[proc(), proc(), proc()], specs=sched + [ffn])
    (f0, wf) = pipe({"status": "ready"})
    assert _wait_ready(procs, [r0, r1, f0], later)["max_total_tokens"] == 7
    bad = {"status": "error", "message": "no such architecture"}
    (r0, w0), (r1, w1) = pipe(ready), pipe(bad)
    two = SimpleNamespace(workers=procs.workers[:2], specs=sched)
    assert _wait_ready(two, [r0, r1], later) == bad
    (r0, w0), (r1, w1b) = pipe(ready), pipe()
    two.workers[1] = proc(alive=False, code=-9)
    out = _wait_ready(two, [r0, r1], later)
    assert out["message"] == "the scheduler process of TP rank 1 died during startup (exit code -9)"
    (f0, wf) = pipe()
    (r0, w0) = pipe(ready)
    one = SimpleNamespace(workers=[proc(), proc(alive=False, code=3)], specs=[sched[0], ffn])
    out = _wait_ready(one, [r0, f0], later)
    assert out["message"] == "FFN worker 0 died during startup (exit code 3)"
    (r0, w0) = mp.Pipe(duplex=False)  # says nothing while alive: the deadline ends the wait
    out = _wait_ready(SimpleNamespace(workers=[proc()], specs=sched[:1]), [r0], time.monotonic() + 0.3)
    assert out["status"] == "error" and "the scheduler did not start within" in out["message"]


@pytest.mark.parametrize("kw, environ, want", [
    (dict(enable_tdist_overlap=True), {}, {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}),
    (dict(enable_tdist_overlap=True), {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, {}),  # an explicit value wins
    (dict(), {}, {}),
])
def test_tdist_workers_get_32_hardware_queues(kw, environ, want, monkeypatch):
    """--enable-tdist-overlap workers (their decomposition ops wait on peers with cuStreamWaitValue64) start with
    CUDA_DEVICE_MAX_CONNECTIONS=32 unless the launcher's environment sets it; other workers get nothing extra."""
    from sglang.srt.deployment import plan_deployment
    from sglang.srt.entrypoints.worker_launcher import process_spec, worker_env

    plan = plan_deployment(ServerArgs(device="cpu", tp_size=2, **kw))
    for w in plan.workers:
        assert worker_env(w, environ) == want
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert [process_spec(w, None).env for w in plan.workers] == [want] * len(plan.workers)
