"""MegaScale-Infer AFD executor (ping-pong over m micro-batches, experts on FFN workers reached through M2N):
logits equal the colocated model's within fp32 tolerance on random small Mixtral, Qwen2-MoE (shared expert,
dense layers) and Qwen3-MoE checkpoints with real top-k routing over random, non-identical experts; live
placement changes (redundant hot experts) between steps keep the logits; a dense model is refused."""

from __future__ import annotations

import os
import sys
import tempfile
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
transformers = pytest.importorskip("transformers")

from model_harness import ModelHarness, randomize_weights  # noqa: E402
from test_models_vs_hf import COMMON, CASES, VOCAB  # noqa: E402

from sglang.srt.afd.executor import AfdExecutor  # noqa: E402
from sglang.srt.afd.experts import moe_layer_specs  # noqa: E402
from sglang.srt.afd.ffn_worker import FfnServer  # noqa: E402
from sglang.srt.afd.load_balance import ExpertPlacement, static_placement  # noqa: E402
from sglang.srt.afd.protocol import AfdTopology  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.model_executor.worker_builder import role_spec  # noqa: E402
from sglang.srt.model_loader.loader import load_model  # noqa: E402

TOL = 2e-5
MOE_CASES = ["mixtral", "qwen2_moe_shared", "qwen3_moe"]


@pytest.fixture(scope="module", params=MOE_CASES)
def ckpt(request, tmp_path_factory):
    cfg_cls, model_cls, extra = CASES[request.param]
    cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).float().eval()
    randomize_weights(hf, seed=11 + sum(map(ord, request.param)))
    path = str(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(path)
    return ModelConfig.from_path(path)


class FfnGroup:
    """N_E FFN servers on threads (the in-process twin of the FFN worker processes)."""

    def __init__(self, mc, topo: AfdTopology):
        specs = moe_layer_specs(mc)
        held = static_placement(specs[0].num_experts, topo.num_ffn).worker_experts()
        self.servers = [FfnServer(mc, specs, held[j], "auto", torch.device("cpu"), topo, j) for j in range(topo.num_ffn)]
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._loop, args=(s,), daemon=True) for s in self.servers]
        for t in self.threads:
            t.start()

    def _loop(self, s: FfnServer) -> None:
        try:
            while not self.stop.is_set():
                s.serve_once(timeout_s=0.2)
        except BaseException as e:
            self.errors.append(e)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)
        for s in self.servers:
            s.ep.close()
        assert not self.errors, self.errors


def _topo(n_a: int, n_e: int) -> AfdTopology:
    d = tempfile.mkdtemp(prefix="afd-test-")
    return AfdTopology(n_a, n_e, tuple(f"ipc://{d}/{i}" for i in range(n_a + n_e)), max_rows=256, timeout_s=30)


def _mixed_steps(h: ModelHarness, seed: int, executor=None) -> list[torch.Tensor]:
    """Prefill of 4 requests, then a mixed step (2 decodes + a chunk), then two decode steps."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    outs = [h.step([("a", rand(7)), ("b", rand(5)), ("c", rand(3)), ("d", rand(4))], executor)]
    outs.append(h.step([("a", rand(1)), ("b", rand(6)), ("c", rand(1)), ("d", rand(1))], executor))
    for _ in range(2):
        outs.append(h.step([(r, rand(1)) for r in "abcd"], executor))
    return outs


@pytest.mark.parametrize("m,n_e", [(1, 2), (2, 2), (3, 1), (4, 2), (2, 3)])
def test_afd_logits_equal_colocated(ckpt, m, n_e):
    mc = ckpt
    ref_model = load_model(mc, "auto", "cpu")
    ref = _mixed_steps(ModelHarness(ref_model, mc), seed=5)
    attn_model = load_model(mc, "auto", "cpu", weight_filter=role_spec("attention").weight_filter)
    topo = _topo(1, n_e)
    ffn = FfnGroup(mc, topo)
    ex = AfdExecutor(mc, topo, 0, m, torch.device("cpu"))
    try:
        out = _mixed_steps(ModelHarness(attn_model, mc), seed=5, executor=ex)
    finally:
        ex.close()
        ffn.close()
    assert ref[0].abs().max() > 0.1
    for i, (a, b) in enumerate(zip(out, ref)):
        diff = (a - b).abs().max().item()
        assert diff < TOL, f"step {i}: AFD m={m} N_E={n_e} differs from colocated by {diff:.3g}"
    assert ex.last_constraint is not None and ex.last_constraint["m_min"] >= 2.0


def test_afd_live_placement_change_keeps_logits(ckpt):
    mc = ckpt
    e = moe_layer_specs(mc)[0].num_experts
    ref = _mixed_steps(ModelHarness(load_model(mc, "auto", "cpu"), mc), seed=9)
    attn_model = load_model(mc, "auto", "cpu", weight_filter=role_spec("attention").weight_filter)
    topo = _topo(1, 2)
    ffn = FfnGroup(mc, topo)
    ex = AfdExecutor(mc, topo, 0, 2, torch.device("cpu"))
    # after the first step, expert 0 is hot: replicate it on both workers, move expert 1 to worker 1
    hot = ExpertPlacement(2, tuple((0, 1) if i == 0 else ((1,) if i == 1 else (i * 2 // e,)) for i in range(e)))
    h = ModelHarness(attn_model, mc)
    orig_step = h.step
    calls = []

    def step(items, executor=None):
        out = orig_step(items, executor)
        calls.append(1)
        if len(calls) == 1:
            ex.apply_placement(hot)  # between steps, in the running system
        return out

    h.step = step
    try:
        out = _mixed_steps(h, seed=9, executor=ex)
        assert ex.version == 1 and ex.placement == hot
        assert ffn.servers[1].expert_ids == [0, 1] + [i for i in range(e) if i * 2 // e == 1 and i > 1]
    finally:
        ex.close()
        ffn.close()
    for a, b in zip(out, ref):
        assert (a - b).abs().max().item() < TOL


def test_afd_refuses_dense_model():
    d = tempfile.mkdtemp()
    cfg = transformers.LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(d)
    with pytest.raises(ValueError, match="needs a MoE model"):
        AfdExecutor(ModelConfig.from_path(d), _topo(1, 1), 0, 2, torch.device("cpu"))


def test_afd_flags_are_validated_and_parsed():
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    for kw, flag in ((dict(afd_micro_batches=0), "afd-micro-batches"), (dict(afd_transport="pigeon"), "afd-transport"),
                     (dict(afd_attention_workers=2, afd_rebalance_interval=5), "afd-rebalance-interval"),
                     (dict(enable_tokenweave=True), "enable-tokenweave")):
        with pytest.raises(ValueError, match=flag):
            ServerArgs(enable_afd=True, **kw)
    a = prepare_server_args(["--enable-afd", "--afd-attention-workers", "2", "--afd-ffn-workers", "4",
                             "--afd-micro-batches", "3", "--afd-timeout-s", "5.5", "--tp", "2"])
    assert (a.enable_afd, a.afd_attention_workers, a.afd_ffn_workers, a.afd_micro_batches, a.afd_timeout_s,
            a.tp_size) == (True, 2, 4, 3, 5.5, 2)
    assert a.disable_cuda_graph and a.chunked_prefill_size == a.afd_max_tokens // 2
    ServerArgs(afd_micro_batches=0)  # ignored without --enable-afd
    for name in ("cuda_push", "cuda_push_ll"):  # device-driven transports: explicit only, parsed and kept
        assert prepare_server_args(["--enable-afd", "--afd-transport", name]).afd_transport == name
