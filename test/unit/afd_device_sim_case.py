"""Device-driven AFD steps (sglang.srt.afd.device_m2n) on CPU, run under TRITON_INTERPRET=1 by test_afd_device_step.py:
the real ``cuda_push`` kernels (flag protocol, or with a trailing ``cuda_push_ll`` argument the low-latency protocol of
sgl_kernel.m2n.ll_kernels) under the Triton interpreter over the one-process CPU stand-in of the CUDA platform
(m2n_push_sim_case.SimPlatform), the attention worker (AfdExecutor, device-driven) on this thread and the FFN
worker(s) (FfnServer serving STEP messages) on threads, on the trained stories260K-moe checkpoint.

The interpreter cannot spin (an unsatisfied device wait is recorded at once), so the test transport first waits on
the host until the flag / ack the kernel will wait for is there (bounded), then launches the real kernel; one lock
keeps interpreted launches of the two threads apart. The checkpoint: ``$AFD_SIM_MODEL`` (default
../shared/data/models/stories260K-moe beside the checkout). Checks (argv[1] names the case):

* ``equal M``: prefill + 2 greedy decode steps, logits within 1e-4 of the colocated model and the same greedy
  tokens, with m = M micro-batches over 1 FFN worker, and over 2 FFN workers (weights of pairs owned by the other
  worker zeroed on the device); the FFN workers served device steps (no DISPATCH / RESULT header on the way);
* ``stray``: 2 FFN workers whose held experts disagree with the attention side's placement: the step raises
  RuntimeError (short answers counted on the device), never returns logits;
* ``dead``: the FFN worker is gone: the step raises TimeoutError from the device waits' error record;
* ``timing M``: ``equal``'s run with step timers on both sides (sglang.srt.afd.step_timing): the logits stay equal,
  the last step has one Ta and one round trip per (MoE layer, micro-batch), each FFN step key one Tf per step, all
  positive, a round trip at least its Tf, and pipeline_check gives Tc >= 0 and m_min >= 2.
The last argument may name the transport (``cuda_push`` default, ``cuda_push_ll``). Prints OK."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from m2n_push_sim_case import SimDriver, SimPlatform  # noqa: E402

from sgl_kernel.m2n.cuda_push import CudaPushTransport  # noqa: E402

import sglang.srt.afd.executor as afd_executor  # noqa: E402
import sglang.srt.afd.ffn_worker as afd_ffn  # noqa: E402
from sglang.srt.afd.experts import moe_layer_specs  # noqa: E402
from sglang.srt.afd.ffn_worker import FfnServer  # noqa: E402
from sglang.srt.afd.load_balance import static_placement  # noqa: E402
from sglang.srt.afd.protocol import AfdTopology  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.model_executor.worker_builder import role_spec  # noqa: E402
from sglang.srt.model_loader.loader import load_model  # noqa: E402
from sglang.test.model_harness import ModelHarness, greedy_logits  # noqa: E402

LOCK = threading.Lock()
DRIVER = SimDriver()
HOST_WAIT_S = 3.0
MODEL = os.environ.get("AFD_SIM_MODEL") or os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                                                       "models", "stories260K-moe")


class ThreadedSimPush(CudaPushTransport):
    """cuda_push over the CPU stand-in, for two threads: host-wait for what the kernel waits for, then launch
    (``protocol``: ``flag`` or ``ll``)."""

    def __init__(self, protocol: str = "flag"):
        super().__init__(wait_timeout_s=1.0, platform=SimPlatform(DRIVER), protocol=protocol)

    @staticmethod
    def _host_wait(ready) -> None:
        deadline = time.monotonic() + HOST_WAIT_S
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.0005)

    def post_send(self, peer, slot, view, rows=0, rows_dev=None, src_rows=-1):
        p = self._peer(peer)
        slots = self.ep.config.slots
        if self.protocol == "ll":  # every program c of the peer's grid waits for its own ack word
            ctr, acks = self.ll_ctr[0, peer], p["acks"]
            self._host_wait(lambda: all(int(acks[c]) >= int(ctr[c]) - slots + 1 for c in range(p["grid"])))
        else:
            self._host_wait(lambda: int(self.acks[peer]) >= int(self.ctr[peer]) - slots + 1)
        with LOCK:
            return super().post_send(peer, slot, view, rows, rows_dev, src_rows)

    def _recv_into(self, src, cap_rows, grid_bytes):
        self._peer(src)
        w, slots = self.ep.world, self.ep.config.slots

        def ready():
            r = int(self.ctr[w + src])
            return int(self.flags[src * slots + r % slots]) >= (r + 1) << 32

        def ready_ll():  # program c's header copy of its next message carries that message's tag
            g, ctr = self.grid, self.ll_ctr[1, src]
            return all((int(self.ll_hdr[(src * slots + int(ctr[c]) % slots) * g + c]) >> 32) & 0xFFFFFFFF
                       == (int(ctr[c]) + 1) & 0xFFFFFFFF for c in range(g))

        self._host_wait(ready_ll if self.protocol == "ll" else ready)
        with LOCK:
            super()._recv_into(src, cap_rows, grid_bytes)


def _transport(name):
    assert name in ("cuda_push", "cuda_push_ll"), name
    return ThreadedSimPush("ll" if name == "cuda_push_ll" else "flag")


afd_executor.create_afd_transport = _transport
afd_ffn.create_afd_transport = _transport


class Ffn:
    """FFN servers on threads (``held``: experts per worker; default the static placement)."""

    def __init__(self, mc, topo, held=None):
        specs = moe_layer_specs(mc)
        held = held or static_placement(specs[0].num_experts, topo.num_ffn).worker_experts()
        self.servers = [FfnServer(mc, specs, held[j], "auto", torch.device("cpu"), topo, j)
                        for j in range(topo.num_ffn)]
        self.stop, self.errors = threading.Event(), []
        self.threads = [threading.Thread(target=self._loop, args=(s,), daemon=True) for s in self.servers]
        for t in self.threads:
            t.start()

    def _loop(self, s):
        try:
            while not self.stop.is_set():
                s.serve_once(timeout_s=0.2)
        except BaseException as e:  # noqa: BLE001 - reported by close()
            self.errors.append(e)

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(30)
        for s in self.servers:
            s.ep.close()


TRANSPORT = "cuda_push"  # or cuda_push_ll: the last argument


def _topo(n_e):
    d = tempfile.mkdtemp(prefix="afd-dev-")
    return AfdTopology(1, n_e, tuple(f"ipc://{d}/{i}" for i in range(1 + n_e)), max_rows=32, transport=TRANSPORT,
                       timeout_s=20)


def ex_protocol() -> str:
    """The M2N protocol the transport under test uses."""
    return "ll" if TRANSPORT == "cuda_push_ll" else "flag"


def _run(mc, attn, m, topo, held=None, kill_ffn=False, timers=None):
    ffn = Ffn(mc, topo, held)
    ex = afd_executor.AfdExecutor(mc, topo, 0, m, torch.device("cpu"))
    if timers is not None:  # before the first STEP: the FFN threads only serve once the executor sends
        from sglang.srt.afd.step_timing import StepTimer

        ex.step_timer = timers["ex"] = StepTimer(torch.device("cpu"))
        for s in ffn.servers:
            s.device_steps.timer = StepTimer(torch.device("cpu"))
    assert ex.dev is not None and ex.graph_captures_executor  # the transport name alone turned device steps on
    assert ex.ep.transport.protocol == ex_protocol(), ex.ep.transport.protocol
    try:
        if kill_ffn:
            ffn.close()
        else:
            ex.prepare_graph_capture()  # what CudaGraphRunner calls first: every FFN worker's handles are in
        out = greedy_logits(ModelHarness(attn, mc, max_reqs=4, max_len=24), ex)
    finally:
        ex.close()
        ffn.close()
    return out, ffn


def case_equal(m: int) -> None:
    mc = ModelConfig.from_path(MODEL)
    ref = greedy_logits(ModelHarness(load_model(mc, "auto", "cpu"), mc, max_reqs=4, max_len=24))
    attn = load_model(mc, "auto", "cpu", weight_filter=role_spec("attention").weight_filter)
    for n_e in (1, 2):
        out, ffn = _run(mc, attn, m, _topo(n_e))
        assert not ffn.errors, ffn.errors
        for s in ffn.servers:  # every step went the device path: (src, sizes) of prefill and both decodes
            assert len(s.device_steps.seen) >= 2, s.device_steps.seen
            assert s.ep.transport.protocol == ex_protocol(), s.ep.transport.protocol
        for i, (a, b) in enumerate(zip(out, ref)):
            diff = (a - b).abs().max().item()
            assert diff < 1e-4, f"m={m} N_E={n_e} step {i}: device-driven AFD differs from colocated by {diff:.3g}"
            assert torch.equal(a.argmax(-1), b.argmax(-1)), f"m={m} N_E={n_e} step {i}: greedy tokens differ"
        assert ref[0].abs().max() > 0.1


def case_timing(m: int) -> None:
    from sglang.srt.afd.step_timing import pipeline_check

    mc = ModelConfig.from_path(MODEL)
    ref = greedy_logits(ModelHarness(load_model(mc, "auto", "cpu"), mc, max_reqs=4, max_len=24))
    attn = load_model(mc, "auto", "cpu", weight_filter=role_spec("attention").weight_filter)
    timers = {}
    out, ffn = _run(mc, attn, m, _topo(1), timers=timers)
    assert not ffn.errors, ffn.errors
    for a, b in zip(out, ref):
        assert (a - b).abs().max().item() < 1e-4 and torch.equal(a.argmax(-1), b.argmax(-1))
    t = timers["ex"]
    layers = len(moe_layer_specs(mc))
    m_eff = min(m, 4)  # the harness decodes max_reqs=4 requests
    assert len(t.pairs["ta"]) == len(t.pairs["rtt"]) == layers * m_eff, {k: len(v) for k, v in t.pairs.items()}
    got = t.collect()
    tf = ffn.servers[0].device_steps.tf_ms
    assert tf and all(len(v) >= 1 and min(v) > 0 for v in tf.values()), tf
    last = tf[max(tf, key=lambda k: len(tf[k]))][-1]
    assert got["ta"] > 0 and got["rtt"] > 0, got
    c = pipeline_check(got["ta"], last, got["rtt"], m_eff)
    assert c["tc_ms"] >= 0 and c["m_min"] >= 2, c
    print(f"timing m={m}: Ta {got['ta']:.3f} Tf {last:.3f} rtt {got['rtt']:.3f} -> Tc {c['tc_ms']:.3f} ms, "
          f"m_min {c['m_min']:.2f}")


def case_stray() -> None:
    mc = ModelConfig.from_path(MODEL)
    attn = load_model(mc, "auto", "cpu", weight_filter=role_spec("attention").weight_filter)
    e = moe_layer_specs(mc)[0].num_experts
    held = [[0], list(range(1, e))]  # the attention side routes by the static blocks [0, 1] / [2, 3]
    try:
        _run(mc, attn, 2, _topo(2), held=held)
    except RuntimeError as err:
        assert "wrong row count" in str(err), err
        return
    raise AssertionError("a step with refused pairs returned logits")


def case_dead() -> None:
    mc = ModelConfig.from_path(MODEL)
    attn = load_model(mc, "auto", "cpu", weight_filter=role_spec("attention").weight_filter)
    t0 = time.monotonic()
    try:
        _run(mc, attn, 1, _topo(1), kill_ffn=True)
    except TimeoutError as err:
        assert "m2n" in str(err), err
        assert time.monotonic() - t0 < 120
        return
    raise AssertionError("a step without an FFN worker returned logits")


if __name__ == "__main__":
    if sys.argv[-1] in ("cuda_push", "cuda_push_ll"):
        TRANSPORT = sys.argv.pop()
    what = sys.argv[1]
    if what == "equal":
        case_equal(int(sys.argv[2]))
    elif what == "timing":
        case_timing(int(sys.argv[2]))
    elif what == "stray":
        case_stray()
    elif what == "dead":
        case_dead()
    print("OK")
