"""Device-driven AFD steps (one STEP host message per step, the per-layer exchange device to device over
``cuda_push``: the path the attention worker's decode CUDA graph captures), on CPU: afd_device_sim_case.py runs the
real M2N kernels under the Triton interpreter over the CPU stand-in of the CUDA platform, attention worker and FFN
workers on threads, on the trained stories260K-moe checkpoint: greedy tokens and logits equal colocated for m = 1,
2, 3 and N_E = 1, 2; a placement mismatch and a dead FFN worker fail the step (RuntimeError / TimeoutError), never
return logits. The same over ``--afd-transport cuda_push_ll`` (the low-latency protocol, sgl_kernel.m2n.ll_kernels):
equal colocated for m = 1, 2 and N_E = 1, 2; a dead FFN worker fails the step. The GPU run (graph capture, 2 GPUs): scripts/gpu/afd_graph_2gpu.sh."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import shared_path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CASE = Path(__file__).resolve().parent / "afd_device_sim_case.py"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _case(*args: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", AFD_SIM_MODEL=shared_path("models", "stories260K-moe"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sgl-kernel" / "python"), str(REPO / "python"),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(CASE), *args], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-1000:] + r.stderr[-3000:]


@pytest.mark.parametrize("m", [1, 2, 3])
def test_device_driven_afd_equals_colocated(m):
    _case("equal", str(m))


@pytest.mark.parametrize("m", [1, 2])
def test_device_driven_afd_step_timers_give_ta_tf_tc(m):
    """afd.step_timing on the device path (what benchmark/afd/bench_step_graph.py reads after each graph replay): per (layer,
    micro-batch) Ta and round trip on the attention side, Tf per step on the FFN side, logits unchanged."""
    _case("timing", str(m))


def test_device_driven_afd_refused_pairs_fail_the_step():
    _case("stray")


def test_device_driven_afd_dead_ffn_fails_closed():
    _case("dead")


@pytest.mark.parametrize("m", [1, 2])
def test_device_driven_afd_ll_protocol_equals_colocated(m):
    """``--afd-transport cuda_push_ll``: both sides' transports use the LL protocol, steps go the device path."""
    _case("equal", str(m), "cuda_push_ll")


def test_device_driven_afd_ll_protocol_dead_ffn_fails_closed():
    _case("dead", "cuda_push_ll")


@pytest.mark.parametrize("m", [1, 2, 3])
def test_split_decode_requests_equals_split_requests_without_copies(m):
    """The graph-safe decode split: the same micro-batches as split_requests, every tensor a view of the batch's."""
    import torch

    from sglang.srt.batch_split import split_decode_requests, split_requests
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model
    from sglang.test.model_harness import ModelHarness

    mc = ModelConfig.from_path(shared_path("models", "stories260K-moe"))
    h = ModelHarness(load_model(mc, "auto", "cpu"), mc, max_reqs=5, max_len=16)
    h.step([(i, [5 + i, 7, 9][: 1 + i % 3]) for i in range(5)])
    fb = h.prepare([(i, [11 + i]) for i in range(5)])
    got, ref = split_decode_requests(fb, m), split_requests(fb, m)
    assert len(got) == len(ref) == m
    for g, r in zip(got, ref):
        assert g.batch_size == r.batch_size and g.token_range == r.token_range
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "prefix_lens",
                     "extend_lens", "extend_start_loc"):
            assert torch.equal(getattr(g, name), getattr(r, name)), name
        for name in ("input_ids", "seq_lens", "req_pool_indices"):  # views of the batch: no host-to-device copy
            assert getattr(g, name).untyped_storage().data_ptr() == getattr(fb, name).untyped_storage().data_ptr()
        assert g.seq_lens_cpu == r.seq_lens_cpu and g.extend_lens_cpu == r.extend_lens_cpu
    with pytest.raises(ValueError, match="DECODE"):
        split_decode_requests(h.prepare([(0, [1, 2])]), 1)


def test_graph_inputs_copied_into_the_captured_batch_give_the_new_steps_logits():
    """benchmark/afd_graph.load_inputs (how a captured step is replayed with new inputs): the captured batch's
    tensors overwritten with the next decode step's give that step's logits; another batch size is refused."""
    import torch

    sys.path.insert(0, str(REPO))
    from benchmark.afd.step_graph import load_inputs

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model
    from sglang.test.model_harness import ModelHarness

    mc = ModelConfig.from_path(shared_path("models", "stories260K-moe"))
    h = ModelHarness(load_model(mc, "auto", "cpu"), mc, max_reqs=3, max_len=16)
    h.step([(i, [5 + i, 7, 9]) for i in range(3)])
    first = h.prepare([(i, [11 + i]) for i in range(3)])
    h.run(first, poison=False)
    nxt = h.prepare([(i, [20 + i]) for i in range(3)])
    want = h.run(nxt, poison=False).clone()
    load_inputs(first, nxt)
    got = h.run(first, poison=False)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="does not fit"):
        load_inputs(first, h.prepare([(0, [1])]))
