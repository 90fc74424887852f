"""Correctness on one GPU: Triton backend + fused ops vs torch_native, CUDA graphs vs eager, GPU vs CPU.

1. For every architecture (small random configs, bf16 on CUDA), a ModelRunner with the Triton attention backend
   and the fused Triton ops gives the logits of a ModelRunner with the torch_native backend and the torch
   reference ops, within bf16 tolerance, for prefill, decode, mixed and cached-prefix extend batches.
   MoE routing can flip between near-tied experts under bf16 rounding; such a request (checked to be a near
   tie) is left out of the strict comparison from then on, and most rows must still be compared.
2. CUDA-graph replay equals eager: one ModelRunner (fp32) with graphs, decode batches of captured and of padded
   sizes, each step also run eagerly on the same runner (graphs off) and on a second runner without graphs
   fed the same steps (which would expose padding rows writing into real KV slots).
3. Greedy end-to-end on stories260K (and its MoE twin): a ``--device cuda --dtype float32`` server (Triton
   backend, CUDA graphs on) gives the CPU server's tokens, with concurrent requests so decode batches vary.

Helpers take a ``device`` so the test logic can be dry-run on CPU (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import re
import sys
import zlib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "test"))

from conftest import gpu_tiered  # noqa: E402

VOCAB = 512
BASE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
            hidden_act="silu", bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
# name -> config.json fields on top of BASE
ARCHS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False,
                  rope_scaling=LLAMA3_ROPE),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=128, num_key_value_heads=1,
                  tie_word_embeddings=False),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=8,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", **MOE,
                      shared_expert_intermediate_size=256, norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", **MOE, norm_topk_prob=True,
                      head_dim=64, decoder_sparse_step=1),
}
BF16_TOL = 0.04  # max |logit error| / max(1, max |ref logit|) for bf16 (2 layers, different kernels)
BF16_MEAN_TOL = 0.006  # the same for the mean |logit error|
GRAPH_TOL = 2e-3  # fp32: graph vs eager differ only by GEMM shapes (padding) and split counts


# ----------------------------------------------------------------------------------------------- helpers
def write_config(tmp: Path, arch: str, dtype: str) -> str:
    """A checkpoint folder with only config.json (weights are dummy, then :func:`randomize`d)."""
    d = tmp / f"{arch}-{dtype}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**BASE, **ARCHS[arch], "torch_dtype": dtype}))
    return str(d)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Fill parameters in place (captured CUDA graphs keep their pointers), identically on every runner:
    norms ~1, biases O(0.1), matrices with O(1) outputs (a CPU generator seeded per parameter name)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
            x = torch.randn(p.shape, generator=gen)
            if p.dim() == 1:
                x = 1.0 + 0.2 * x if "norm" in name else 0.2 * x
            elif "embed" not in name:
                x = x / p.shape[-1] ** 0.5
            p.copy_(x.to(p.dtype))


def make_runner(path: str, backend: str, dtype: str, device: str, graphs: bool = False, max_bs: int = 16,
                seed: int = 1, kv_cache_dtype: str = "auto"):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=path, load_format="dummy", dtype=dtype, device=device.split(":")[0],
                      attention_backend=backend, max_total_tokens=8192, max_running_requests=32,
                      disable_cuda_graph=not graphs, cuda_graph_max_bs=max_bs, kv_cache_dtype=kv_cache_dtype)
    mc = ModelConfig.from_path(path, None, dtype, device.split(":")[0])
    runner = ModelRunner(mc, args, device)
    randomize(runner.model, seed)
    return runner


@contextlib.contextmanager
def reference_ops():
    """Make :mod:`sglang.srt.layers.ops` use its torch references on CUDA too."""
    from sglang.srt.layers import ops

    saved = ops._triton
    ops._triton = lambda t, name: None
    try:
        yield
    finally:
        ops._triton = saved


class Driver:
    """Feeds a ModelRunner step by step: ``step([(rid, new_token_ids), ...]) -> logits [bs, V]`` (a copy).

    A new rid takes a request row and prefills; a known rid extends its cached prefix (one token: decode).
    Mode: DECODE when all rows decode, EXTEND when none does, MIXED otherwise.
    """

    def __init__(self, runner, ref_ops: bool = False):
        self.runner, self.ref_ops = runner, ref_ops
        self.rows: dict = {}
        self.lens: dict = {}

    def batch(self, items):
        from sglang.srt.forward_batch_info import ForwardMode, ModelWorkerBatch
        from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
        from sglang.srt.sampling.sampling_params import SamplingParams

        r = self.runner
        ids, pos, rows, prefix, ext = [], [], [], [], []
        for rid, new in items:
            if rid not in self.rows:
                self.rows[rid] = r.req_to_token_pool.alloc(1)[0]
                self.lens[rid] = 0
            p = self.lens[rid]
            ids += new
            pos += range(p, p + len(new))
            rows.append(self.rows[rid])
            prefix.append(p)
            ext.append(len(new))
        locs = r.allocator.alloc(len(ids))
        assert locs is not None, "test KV pool exhausted"
        off = 0
        for (rid, new), row in zip(items, rows):
            r.req_to_token_pool.write(row, self.lens[rid], locs[off:off + len(new)])
            self.lens[rid] += len(new)
            off += len(new)
        dec = [e == 1 and p > 0 for p, e in zip(prefix, ext)]
        mode = ForwardMode.DECODE if all(dec) else ForwardMode.MIXED if any(dec) else ForwardMode.EXTEND
        params = []
        for _ in items:
            sp = SamplingParams(temperature=0.0, max_new_tokens=8)
            sp.normalize(None)
            params.append(sp)
        info = SamplingBatchInfo.from_reqs(params, r.device, r.model_config.vocab_size, [[] for _ in items])
        return ModelWorkerBatch(forward_mode=mode, input_ids=ids, positions=pos, out_cache_loc=locs,
                                req_pool_indices=rows, prefix_lens=prefix, extend_lens=ext,
                                seq_lens=[p + e for p, e in zip(prefix, ext)], sample=[True] * len(items),
                                top_logprobs_nums=[0] * len(items), sampling_info=info)

    def run(self, batch, use_graphs: bool = True) -> torch.Tensor:
        r = self.runner
        saved = r.cuda_graph_runner
        if not use_graphs:
            r.cuda_graph_runner = None
        try:
            with reference_ops() if self.ref_ops else contextlib.nullcontext():
                logits_out, _ = r.forward(batch)
            return logits_out.next_token_logits.float().clone()
        finally:
            r.cuda_graph_runner = saved

    def step(self, items) -> torch.Tensor:
        return self.run(self.batch(items))


def router_hooks(model, sink: list):
    """Record every MoE router's logits [N, E] (in call order) into ``sink``; returns the hook handles."""
    from sglang.srt.models.mixtral import SparseMoeBlock

    return [m.gate.register_forward_hook(lambda mod, inp, out: sink.append(out.detach().float().cpu()))
            for m in model.modules() if isinstance(m, SparseMoeBlock)]


def routing_flips(ref_logits: list, test_logits: list, ext_lens: list[int], top_k: int) -> dict[int, float]:
    """Rows (batch index) with a token whose top-k expert set differs between the runs -> the reference's
    gap between its k-th and (k+1)-th router logit at that token (small for a genuine near tie)."""
    flips: dict[int, float] = {}
    owner = torch.repeat_interleave(torch.arange(len(ext_lens)), torch.tensor(ext_lens))
    for a, b in zip(ref_logits, test_logits):
        sa = a.topk(top_k, dim=-1).indices.sort(dim=-1).values
        sb = b.topk(top_k, dim=-1).indices.sort(dim=-1).values
        top = a.topk(top_k + 1, dim=-1).values
        for t in (sa != sb).any(dim=-1).nonzero().flatten().tolist():
            gap = float(top[t, top_k - 1] - top[t, top_k])
            row = int(owner[t])
            flips[row] = max(flips.get(row, 0.0), gap)
    return flips


def scenario(seed: int) -> list[list[tuple[str, list[int]]]]:
    """Steps: prefill, decode, mixed (new prompt + cached-prefix extend + decodes), decodes, chunked prefill."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    return [
        [("a", toks(37)), ("b", toks(5)), ("c", toks(64))],
        [("a", toks(1)), ("b", toks(1)), ("c", toks(1))],
        [("a", toks(1)), ("d", toks(20)), ("b", toks(7)), ("c", toks(1))],
        [("a", toks(1)), ("b", toks(1)), ("c", toks(1)), ("d", toks(1))],
        [("e", toks(100)), ("a", toks(1)), ("d", toks(1))],
        [("e", toks(50)), ("b", toks(1))],
        [("a", toks(1)), ("b", toks(1)), ("c", toks(1)), ("d", toks(1)), ("e", toks(1))],
        [("a", toks(1)), ("b", toks(1)), ("c", toks(1)), ("d", toks(1)), ("e", toks(1))],
    ]


def compare_backends(path: str, device: str, test_backend: str = "triton", dtype: str = "bfloat16") -> dict:
    """Run :func:`scenario` on a torch_native+reference-ops runner and a ``test_backend``+fused-ops runner.

    Returns {"rows": compared rows, "skipped": rows left out after a near-tie routing flip, "worst": worst
    max-error ratio}; raises AssertionError on a mismatch (message: step, mode, row, errors).
    """
    ref = Driver(make_runner(path, "torch_native", dtype, device), ref_ops=True)
    test = Driver(make_runner(path, test_backend, dtype, device, graphs=False))
    top_k = int(ref.runner.model_config.get("num_experts_per_tok", 0) or 0)
    tainted: set[str] = set()
    rows = skipped = 0
    worst = 0.0
    for i, items in enumerate(scenario(7)):
        rl, tl = [], []
        hooks = router_hooks(ref.runner.model, rl) + router_hooks(test.runner.model, tl)
        try:
            bref, btest = ref.batch(items), test.batch(items)
            mode = bref.forward_mode.name
            a, b = ref.run(bref), test.run(btest)
        finally:
            for h in hooks:
                h.remove()
        if top_k:
            flips = routing_flips(rl, tl, bref.extend_lens, top_k)
            for row, gap in flips.items():
                assert gap < 0.05, f"step {i} ({mode}): row {row} routed differently with a router gap of {gap:.4f}"
                tainted.add(items[row][0])
        scale = max(1.0, a.abs().max().item())
        for row, (rid, _) in enumerate(items):
            if rid in tainted:
                skipped += 1
                continue
            err = (a[row] - b[row]).abs()
            worst = max(worst, err.max().item() / scale)
            assert err.max().item() <= BF16_TOL * scale and err.mean().item() <= BF16_MEAN_TOL * scale, (
                f"step {i} ({mode}) request {rid}: max err {err.max().item():.4g}, mean err "
                f"{err.mean().item():.4g}, logit scale {scale:.3g}")
            assert torch.isfinite(b[row]).all()
            rows += 1
    assert rows >= skipped, f"too many requests left out after routing flips: {rows} compared, {skipped} skipped"
    return {"rows": rows, "skipped": skipped, "worst": worst, "backend": test.runner.attention_backend_name,
            "backend_class": type(test.runner.attn_backend).__name__}


def compare_graphs(path: str, dtype: str = "float32", max_bs: int = 16, device: str = "cuda",
                   kv_cache_dtype: str = "auto") -> dict:
    """Decode batches of several sizes on a graph runner: replay vs eager on the same runner and vs a
    second runner without graphs (both with ``--kv-cache-dtype kv_cache_dtype``). Returns {"replayed": padded sizes
    replayed, "eager_steps": n, "worst": r}."""
    g_runner = make_runner(path, "triton", dtype, device, graphs=True, max_bs=max_bs, kv_cache_dtype=kv_cache_dtype)
    assert g_runner.cuda_graph_runner is not None, "CUDA graphs were not captured (see the log)"
    gr = g_runner.cuda_graph_runner
    from sglang.srt.model_executor.cuda_graph_runner import capture_batch_sizes

    assert gr.batch_sizes == capture_batch_sizes(max_bs) and gr.max_bs == max_bs
    replayed: list[int] = []
    real_replay = gr.replay

    def spy(batch, padded=None):  # padded: the size DP attention agreed on (None without DP attention)
        replayed.append(gr.padded_size(batch.batch_size) if padded is None else padded)
        return real_replay(batch, padded)

    gr.replay = spy
    drv = Driver(g_runner)
    other = Driver(make_runner(path, "triton", dtype, device, graphs=False, kv_cache_dtype=kv_cache_dtype))
    gen = torch.Generator().manual_seed(3)
    rids = [f"r{i}" for i in range(20)]
    prompts = [(rid, torch.randint(3, VOCAB, (int(torch.randint(5, 40, (1,), generator=gen)),),
                                   generator=gen).tolist()) for rid in rids]
    for chunk in (prompts[:10], prompts[10:]):
        a, b = drv.step(chunk), other.step(chunk)
        torch.testing.assert_close(a, b, rtol=GRAPH_TOL, atol=GRAPH_TOL * max(1.0, b.abs().max().item()))
    worst, eager_steps = 0.0, 0
    for size in (1, 3, 8, 13, 16, 20, 2, 5, 16, 1):
        start = (7 * size) % len(rids)
        sel = [rids[(start + j) % len(rids)] for j in range(size)]
        items = [(rid, torch.randint(3, VOCAB, (1,), generator=gen).tolist()) for rid in sel]
        batch, batch2 = drv.batch(items), other.batch(items)
        n_before = len(replayed)
        graph_logits = drv.run(batch)
        used_graph = len(replayed) > n_before
        assert used_graph == (size <= max_bs), f"decode batch {size}: graph used={used_graph}"
        eager_logits = drv.run(batch, use_graphs=False)
        other_logits = other.run(batch2)
        eager_steps += not used_graph
        scale = max(1.0, eager_logits.abs().max().item())
        for what, x in (("eager (same runner)", eager_logits), ("eager (second runner)", other_logits)):
            err = (graph_logits - x).abs().max().item()
            worst = max(worst, err / scale)
            assert err <= GRAPH_TOL * scale, f"decode batch {size}: graph vs {what}: max err {err:.4g} (scale {scale:.3g})"
    assert {1, 4, 8, 16}.issubset(set(replayed)), f"replayed padded sizes {replayed}"
    return {"replayed": replayed, "eager_steps": eager_steps, "worst": worst}


# ------------------------------------------------------------------------------------------------- tests
@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_triton_backend_and_fused_ops_match_torch_native_bf16(arch, tmp_path):
    from sglang.srt.layers import ops

    assert ops._triton(torch.empty(1, device="cuda"), "fused_add_rmsnorm") is not None, "Triton kernels unusable"
    res = compare_backends(write_config(tmp_path, arch, "bfloat16"), "cuda")
    print(f"{arch}: {res}")
    assert res["backend_class"] == "TritonAttnBackend"


@pytest.mark.gpu
def test_default_backend_on_cuda_is_triton_with_graphs(tmp_path):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    path = write_config(tmp_path, "llama", "bfloat16")
    args = ServerArgs(model_path=path, load_format="dummy", device="cuda", max_total_tokens=4096,
                      max_running_requests=12)
    assert args.resolved_attention_backend == "triton"
    runner = ModelRunner(ModelConfig.from_path(path, None, "auto", "cuda"), args, "cuda")
    assert runner.attention_backend_name == "triton"
    assert runner.cuda_graph_runner is not None and runner.cuda_graph_runner.max_bs == 12
    assert runner.cuda_graph_runner.batch_sizes == [1, 2, 4, 8, 12]
    assert runner.req_to_token_pool.available_size() == 13 and not runner.req_to_token_pool.req_to_token[
        runner.pad_req_idx].any()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3"])
def test_cuda_graph_replay_equals_eager(arch, tmp_path):
    res = compare_graphs(write_config(tmp_path, arch, "float32"))
    print(f"{arch}: {res}")


@pytest.mark.gpu
def test_graph_greedy_ids_equal_the_sampler(tmp_path, monkeypatch):
    """Decode steps of greedy batches (sizes 1..16, padded) take their ids from the argmax captured in the graph (always
    on), and those equal the sampler's argmax on the same logits; the sampler is not called."""
    runner = make_runner(write_config(tmp_path, "llama", "bfloat16"), "triton", "bfloat16", "cuda", graphs=True)
    gr = runner.cuda_graph_runner
    assert gr is not None and set(gr.greedy_outputs) == set(gr.batch_sizes)
    drv = Driver(runner)
    gen = torch.Generator().manual_seed(5)
    rids = [f"g{i}" for i in range(16)]
    drv.step([(rid, torch.randint(3, VOCAB, (9,), generator=gen).tolist()) for rid in rids])
    calls = []
    real = runner.sampler.forward
    monkeypatch.setattr(runner.sampler, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    for size in (1, 3, 8, 13, 16):
        batch = drv.batch([(rid, torch.randint(3, VOCAB, (1,), generator=gen).tolist()) for rid in rids[:size]])
        logits_out, sample_out = runner.forward(batch)
        ids = sample_out.next_token_ids.clone()
        ref = real(logits_out.next_token_logits.clone(), batch.sampling_info).next_token_ids
        assert torch.equal(ids, ref), f"batch {size}: graph argmax {ids.tolist()} != sampler {ref.tolist()}"
    assert calls == []


# ------------------------------------------------------------------------------- end to end vs the CPU run
PROMPTS = ["Once upon a time", "Lily and Tom went to the park", "The little dog", "One day, a big bird",
           "Tim had a red ball.", "Mom said", "There was a tree", "Sue liked to", "The sun was",
           "A cat and a dog", "Ben saw a", "In the garden"]
N_NEW = 48


def _greedy_all(url: str) -> list[dict]:
    import requests

    def one(p):
        r = requests.post(url + "/generate", timeout=300, json={
            "text": p, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW}})
        assert r.status_code == 200, r.text
        return r.json()

    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:  # concurrent: decode batches of varying sizes
        return list(ex.map(one, PROMPTS))


@pytest.mark.parametrize("model", gpu_tiered(["stories260K", "stories260K-moe"]))
def test_greedy_e2e_cuda_matches_cpu(model):
    from conftest import shared_path
    from server_utils import ServerProcess

    path = shared_path("models", model)
    common = ["--model-path", path, "--chunked-prefill-size", "64"]
    with ServerProcess([*common, "--device", "cpu"]) as s:
        cpu = _greedy_all(s.url)
    with ServerProcess([*common, "--device", "cuda", "--dtype", "float32", "--cuda-graph-max-bs", "8"],
                       timeout=600) as s:
        gpu = _greedy_all(s.url)
        log = open(s.log_path).read()
    assert "attention backend triton" in log and re.search(r"captured CUDA graphs for decode batch sizes", log), \
        log[-4000:]
    ties = []
    for p, c, g in zip(PROMPTS, cpu, gpu):
        if c["output_ids"] == g["output_ids"]:
            continue
        j = next((i for i, (x, y) in enumerate(zip(c["output_ids"], g["output_ids"])) if x != y),
                 min(len(c["output_ids"]), len(g["output_ids"])))
        top = c["meta_info"]["output_top_logprobs"][j] if j < len(c["meta_info"]["output_top_logprobs"]) else []
        gap = top[0][0] - top[1][0] if len(top) >= 2 else float("inf")
        msg = (f"{model} prompt {p!r}: CPU and GPU diverge at output token {j}: cpu {c['output_ids'][j:j + 5]} "
               f"gpu {g['output_ids'][j:j + 5]}; CPU top-2 logprobs {top}\ncpu: {c['text']!r}\ngpu: {g['text']!r}")
        print(msg)
        assert gap < 0.05, msg  # only a near tie may break the greedy equality (fp32 dots run in TF32)
        ties.append(p)
    assert len(ties) <= 3, f"{len(ties)} prompts diverged at near ties: {ties}"
