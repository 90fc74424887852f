"""The paths ``benchmark/afd/bench.py --mode decode`` times on a GPU, checked on CPU under the Triton interpreter on the
trained stories260K-moe checkpoint: :class:`ModelHarness` with the Triton attention backend (real
``MHATokenToKVPool``) gives the torch_native reference's logits and greedy tokens, and so does the AFD attention
worker (ping-pong over m micro-batches, experts on an FFN worker) running on that backend. On a CUDA host this module
skips (``TRITON_INTERPRET`` must be set before any kernel module is imported; the GPU script runs the compiled path).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA host: scripts/gpu/afd_decode_2gpu.sh runs the compiled kernels", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("triton was imported (by an earlier-collected test module) before TRITON_INTERPRET=1 was set, so its "
                "library functions are compiled-mode; import triton lazily in that module", pytrace=False)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from conftest import shared_path  # noqa: E402
from test_afd_executor import FfnGroup, _topo  # noqa: E402

from sglang.srt.afd.executor import AfdExecutor  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.model_executor.worker_builder import role_spec  # noqa: E402
from sglang.srt.model_loader.loader import load_model  # noqa: E402
from sglang.test.model_harness import ModelHarness, greedy_logits  # noqa: E402

TOL = 1e-4


def _greedy(h, executor=None) -> list[torch.Tensor]:
    return greedy_logits(h, executor, steps=2)


@pytest.fixture(scope="module")
def mc():
    return ModelConfig.from_path(shared_path("models", "stories260K-moe"))


def test_harness_triton_backend_equals_torch_native(mc):
    model = load_model(mc, "auto", "cpu")
    ref = _greedy(ModelHarness(model, mc, max_reqs=4, max_len=24))
    out = _greedy(ModelHarness(model, mc, max_reqs=4, max_len=24, attention_backend="triton"))
    assert ref[0].abs().max() > 0.1
    for i, (a, b) in enumerate(zip(out, ref)):
        assert (a - b).abs().max().item() < TOL, f"step {i}"
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"step {i}: greedy tokens differ"


@pytest.mark.parametrize("m", [1, 2])
def test_afd_on_triton_backend_equals_colocated(mc, m):
    ref = _greedy(ModelHarness(load_model(mc, "auto", "cpu"), mc, max_reqs=4, max_len=24))
    attn = load_model(mc, "auto", "cpu", weight_filter=role_spec("attention").weight_filter)
    topo = _topo(1, 1)
    ffn = FfnGroup(mc, topo)
    ex = AfdExecutor(mc, topo, 0, m, torch.device("cpu"))
    try:
        out = _greedy(ModelHarness(attn, mc, max_reqs=4, max_len=24, attention_backend="triton"), ex)
        c = ex.pipeline_constraint()
    finally:
        ex.close()
        ffn.close()
    for i, (a, b) in enumerate(zip(out, ref)):
        assert (a - b).abs().max().item() < TOL, f"step {i}: AFD m={m} on the Triton backend differs"
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"step {i}: greedy tokens differ"
    assert c["ta_ms"] > 0 and c["tf_ms"] > 0 and c["m_min"] >= 2.0


def test_harness_rejects_unknown_backend(mc):
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        ModelHarness(load_model(mc, "auto", "cpu"), mc, attention_backend="flash")
