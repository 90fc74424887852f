"""The sequence-parallel executor (``--enable-tdist-overlap``; token-sharded residual, column-parallel linears on
gathered tokens, row-parallel linears reduce-scattered) on gloo TP ranks (CPU, torch sequence-parallel ops):
logits equal the single-process model's on random dense configs at TP 2 and 4 (uneven and empty token shards in
the decode steps), greedy tokens equal the single process's on the real stories260K checkpoint, and MoE models are
refused with a ValueError. The fused Triton-distributed ops are checked against these on GPUs
(test/gpu/test_tdist_gpu.py)."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
transformers = pytest.importorskip("transformers")

from conftest import shared_path  # noqa: E402
from model_harness import randomize_weights  # noqa: E402
from test_tp_models import ATOL, CASES, COMMON, RTOL, _reference  # noqa: E402
from tp_worker import STEPS, harness_for, spawn_ranks  # noqa: E402

NEEDED = ("llama_bias_untied", "llama_tied", "mixtral")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Random HF checkpoints (fresh seed) of the architectures this module needs (see test_tp_models.CASES)."""
    seed = int.from_bytes(os.urandom(2), "little")
    paths = {}
    for name in NEEDED:
        cfg_cls, model_cls, extra = CASES[name]
        torch.manual_seed(seed)
        hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**COMMON, **extra)).float().eval()
        randomize_weights(hf, seed + sum(map(ord, name)))
        paths[name] = str(tmp_path_factory.mktemp(name))
        hf.save_pretrained(paths[name])
    return paths


def _executor(ps, model):
    from sglang.srt.model_executor.executors.sequence_parallel import create_sequence_parallel_executor

    # min_tokens 0: the layout for every batch (auto would run torch ops' batches sequentially; see
    # test_tdist_auto_select.py for the selection)
    return create_sequence_parallel_executor(model, ps, SimpleNamespace(chunked_prefill_size=64, max_running_requests=8,
                                                                        tdist_overlap_min_tokens=0))


def sp_logits(ps, path: str) -> list:
    """Rank body: the checkpoint sharded for this rank, every STEPS batch through the sequence-parallel executor."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.communicator import create_communicator
    from sglang.srt.model_loader.loader import load_model

    config = ModelConfig.from_path(path)
    model = load_model(config, "auto", "cpu", tp_rank=ps.tp_rank, tp_size=ps.tp_size,
                       comm=create_communicator(ps, "auto"))
    ex = _executor(ps, model)
    h = harness_for(model, config, ps.tp_size)
    return [h.run(h.prepare(items), ex).float().clone() for items in STEPS]


def greedy_tokens(ps, path: str, prompt: list, steps: int) -> list:
    """Rank body (ps None: one process, plain forward): greedy continuation of ``prompt``."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.communicator import create_communicator
    from sglang.srt.model_loader.loader import load_model

    config = ModelConfig.from_path(path)
    tp = dict(tp_rank=ps.tp_rank, tp_size=ps.tp_size, comm=create_communicator(ps, "auto")) if ps else {}
    model = load_model(config, "auto", "cpu", **tp)
    ex = _executor(ps, model) if ps else None
    h = harness_for(model, config, ps.tp_size if ps else 1)
    out, new = [], list(prompt)
    for _ in range(steps):
        tok = int(h.run(h.prepare([("r", new)]), ex)[0].argmax())
        out.append(tok)
        new = [tok]
    return out


@pytest.mark.parametrize("name,world", [("llama_bias_untied", 2), ("llama_tied", 4)])
def test_sequence_parallel_logits_equal_single_process(checkpoints, name, world):
    ref = _reference(checkpoints[name])
    results = spawn_ranks(sp_logits, world, checkpoints[name], timeout=300)
    for rank, per_rank in enumerate(results):
        for step, (got, want) in enumerate(zip(per_rank, ref)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{name} tp{world} rank {rank} step {step}: {m}")


def test_sequence_parallel_stories260k_tokens_equal_single_process():
    path = shared_path("models", "stories260K")
    prompt = [1, 403, 407, 261, 378, 300, 305]  # stories260K has a 512-token vocabulary
    want = greedy_tokens(None, path, prompt, 12)
    for rank, got in enumerate(spawn_ranks(greedy_tokens, 2, path, prompt, 12, timeout=300)):
        assert got == want, f"rank {rank}: {got} != single process {want}"


def test_moe_models_are_refused(checkpoints):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    model = load_model(ModelConfig.from_path(checkpoints["mixtral"]), "auto", "cpu")
    with pytest.raises(ValueError, match="dense decoders only"):
        _executor(None, model)


def test_layout_installed_once_and_active_only_during_a_forward(checkpoints):
    """The linears and residual norms get the executor's layout once (first forward); later forwards assign no
    module attribute (only the layout's rows change, and they are None outside a forward, so the plain path -- e.g.
    CUDA graph capture -- is untouched); results equal the plain forward (one rank)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.model_loader.loader import load_model

    path = checkpoints["llama_tied"]
    config = ModelConfig.from_path(path)
    model = load_model(config, "auto", "cpu")
    ex = _executor(None, model)
    plain = harness_for(model, config, 1)
    want = [plain.run(plain.prepare(items), None).float().clone() for items in STEPS]
    h = harness_for(model, config, 1)  # its own KV cache: the steps continue each other
    got = [h.run(h.prepare(STEPS[0]), ex).float().clone()]
    holders = [m for m in model.modules() if getattr(m, "sequence_parallel", None) is not None]
    assert holders and all(m.sequence_parallel is ex.layout for m in holders)
    assert any(isinstance(m, LinearBase) for m in holders) and ex.layout.rows is None
    seen = []
    orig = torch.nn.Module.__setattr__

    def spy(self, name, value):
        if name == "sequence_parallel":
            seen.append(type(self).__name__)
        orig(self, name, value)

    torch.nn.Module.__setattr__ = spy
    try:
        got += [h.run(h.prepare(items), ex).float().clone() for items in STEPS[1:]]
    finally:
        torch.nn.Module.__setattr__ = orig
    assert not seen, f"a forward re-assigned sequence_parallel on {seen[:3]}"
    assert ex.layout.rows is None
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {step}: {m}")
