"""CPU-testable parts of the GPU path: capture sizes, the reserved padding row, the default attention
backend, when CUDA graphs are (not) created, ModelRunner.forward's graph/eager dispatch, and layers calling
:mod:`sglang.srt.layers.ops` (CPU results are the torch references, bit for bit)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers import ops
from sglang.srt.layers.activation import SiluAndMul, silu_and_mul_ref
from sglang.srt.layers.layernorm import RMSNorm, rmsnorm_ref
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.moe.fused_moe import FusedMoE, fused_moe_ref
from sglang.srt.layers.moe.router import select_experts
from sglang.srt.model_executor.cuda_graph_runner import (CudaGraphRunner, capture_batch_sizes, graph_greedy_eligible,
                                                         maybe_create_cuda_graph_runner)
from sglang.srt.forward_batch_info import ForwardMode, ModelWorkerBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

VOCAB = 64


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


# ------------------------------------------------------------------------------------- capture sizes
@pytest.mark.parametrize("max_bs", [1, 3, 8, 12, 16, 100, 160, 256, 300, 600])
def test_capture_batch_sizes_cover_every_batch(max_bs):
    sizes = capture_batch_sizes(max_bs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_bs
    for bs in range(1, max_bs + 1):
        padded = min(s for s in sizes if s >= bs)
        step = 8 if bs <= 256 else 16 if bs <= 512 else 32  # SGLang's list: every 8 to 256, 16 to 512, then 32
        assert padded - bs < step and padded <= 2 * bs  # padding wastes little
    assert all(s in sizes for s in range(16, min(max_bs, 256) + 1, 8))
    assert (12 in sizes) == (max_bs >= 12)


def test_capture_batch_sizes_rejects_zero():
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        capture_batch_sizes(0)


def _bare_graph_runner(max_bs: int) -> CudaGraphRunner:
    g = object.__new__(CudaGraphRunner)  # no CUDA: only the size bookkeeping
    g.batch_sizes = capture_batch_sizes(max_bs)
    g.max_bs = max_bs
    return g


def _decode_batch(bs: int, rows=None, logprob_rows=False) -> ModelWorkerBatch:
    rows = rows or list(range(bs))
    return ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE, input_ids=[5] * bs, positions=[3] * bs,
        out_cache_loc=torch.arange(1, bs + 1), req_pool_indices=rows, prefix_lens=[3] * bs, extend_lens=[1] * bs,
        seq_lens=[4] * bs, sample=[True] * bs, top_logprobs_nums=[0] * bs,
        input_logprob_indices=[[0]] * bs if logprob_rows else [],
    )


def test_can_run_and_padded_size():
    g = _bare_graph_runner(12)
    assert [g.padded_size(b) for b in (1, 2, 3, 5, 9, 12)] == [1, 2, 4, 8, 12, 12]
    assert g.can_run(_decode_batch(12)) and not g.can_run(_decode_batch(13))
    assert not g.can_run(_decode_batch(2, logprob_rows=True))
    mixed = _decode_batch(2)
    mixed.forward_mode = ForwardMode.MIXED
    assert not g.can_run(mixed)
    with pytest.raises(ValueError, match="outside the captured range"):
        g.padded_size(13)


# ------------------------------------------------------------------------------------- default backend
def test_default_attention_backend(monkeypatch):
    assert ServerArgs(device="cpu").resolved_attention_backend == "torch_native"
    assert ServerArgs(device="cpu", attention_backend="triton").resolved_attention_backend == "triton"
    assert ServerArgs(device="cuda", attention_backend="torch_native").resolved_attention_backend == "torch_native"
    pytest.importorskip("triton")
    assert ServerArgs(device="cuda").resolved_attention_backend == "triton"
    monkeypatch.setitem(sys.modules, "triton", None)  # "triton does not import"
    assert ServerArgs(device="cuda").resolved_attention_backend == "torch_native"


def test_no_cuda_graphs_off_cuda_or_when_disabled():
    cuda_runner = SimpleNamespace(device=torch.device("cuda"), max_running_requests=8)
    cpu_runner = SimpleNamespace(device=torch.device("cpu"), max_running_requests=8)
    assert maybe_create_cuda_graph_runner(cpu_runner, ServerArgs(device="cpu"), 0) is None
    assert maybe_create_cuda_graph_runner(cuda_runner, ServerArgs(device="cuda", disable_cuda_graph=True), 0) is None
    assert maybe_create_cuda_graph_runner(cuda_runner, ServerArgs(device="cuda"), None) is None
    args = ServerArgs(device="cuda", attention_backend="torch_native")
    assert maybe_create_cuda_graph_runner(cuda_runner, args, 0) is None
    assert maybe_create_cuda_graph_runner(cuda_runner, ServerArgs(device="cuda"), 0, backend_name="torch_native") is None


# ------------------------------------------------------------------------------------- ModelRunner
@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=32,
        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-6, torch_dtype="float32")))
    args = ServerArgs(model_path=str(d), load_format="dummy", device="cpu", max_total_tokens=512,
                      max_running_requests=5)
    r = ModelRunner(ModelConfig.from_path(str(d), None, "auto", "cpu"), args, "cpu")
    with torch.no_grad():  # O(1) logits instead of the dummy loader's tiny weights
        g = torch.Generator().manual_seed(0)
        for p in r.model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 4.0) + (p.dim() == 1))
    return r


def test_pad_row_is_reserved_and_zero(runner):
    pool = runner.req_to_token_pool
    assert runner.attention_backend_name == "torch_native" and runner.cuda_graph_runner is None
    assert 0 <= runner.pad_req_idx < pool.size and not pool.req_to_token[runner.pad_req_idx].any()
    assert runner.local_num_heads == 4
    # the scheduler still gets max_running_requests + 1 rows, none of which is the pad row
    assert pool.available_size() == runner.max_running_requests + 1
    rows = pool.alloc(pool.available_size())
    try:
        assert runner.pad_req_idx not in rows and pool.alloc(1) is None
    finally:
        pool.free(rows)


def _prefill_then_decode(runner, gen):
    """Prefill two requests (eager), then build their decode batch; returns (decode batch, cleanup)."""
    pool, alloc = runner.req_to_token_pool, runner.allocator
    lens = [5, 3]
    rows = pool.alloc(2)
    prompt = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]
    locs = alloc.alloc(sum(lens))
    pool.write(rows[0], 0, locs[:5])
    pool.write(rows[1], 0, locs[5:])
    params = [SamplingParams(temperature=0.0) for _ in lens]
    for p in params:
        p.normalize(None)
    info = SamplingBatchInfo.from_reqs(params, "cpu", VOCAB, [[], []])
    runner.forward(ModelWorkerBatch(
        forward_mode=ForwardMode.EXTEND, input_ids=prompt[0] + prompt[1], positions=[0, 1, 2, 3, 4, 0, 1, 2],
        out_cache_loc=locs, req_pool_indices=rows, prefix_lens=[0, 0], extend_lens=lens, seq_lens=lens,
        sample=[True, True], top_logprobs_nums=[0, 0], sampling_info=info))
    dloc = alloc.alloc(2)
    pool.write(rows[0], 5, dloc[:1])
    pool.write(rows[1], 3, dloc[1:])
    info = SamplingBatchInfo.from_reqs(params, "cpu", VOCAB, [[], []])
    batch = ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE, input_ids=[7, 9], positions=[5, 3], out_cache_loc=dloc,
        req_pool_indices=rows, prefix_lens=[5, 3], extend_lens=[1, 1], seq_lens=[6, 4], sample=[True, True],
        top_logprobs_nums=[0, 0], sampling_info=info)

    def cleanup():
        pool.free(rows)
        alloc.free(torch.cat([locs, dloc]))

    return batch, cleanup


class _FakeGraphs:
    def __init__(self, logits, runs: bool):
        self.logits, self.runs, self.replayed = logits, runs, []

    def can_run(self, batch):
        return self.runs

    def replay(self, batch, padded=None):
        assert padded is None  # no DP attention: the runner lets the graph pick the padded size
        self.replayed.append(batch.batch_size)
        return LogitsProcessorOutput(next_token_logits=self.logits.clone())

    def greedy_ids(self, batch, padded=None):
        return None


def test_forward_replays_graphs_for_decode_batches_that_fit(runner, gen):
    batch, cleanup = _prefill_then_decode(runner, gen)
    try:
        eager_logits, eager_sample = runner.forward(batch)
        fake = torch.randn(2, VOCAB, generator=gen)
        runner.cuda_graph_runner = _FakeGraphs(fake, runs=True)
        logits, sample = runner.forward(batch)
        assert runner.cuda_graph_runner.replayed == [2]
        assert torch.equal(logits.next_token_logits, fake) and torch.equal(sample.next_token_ids, fake.argmax(-1))
        runner.cuda_graph_runner = _FakeGraphs(fake, runs=False)  # does not fit: eager
        logits, sample = runner.forward(batch)
        assert runner.cuda_graph_runner.replayed == []
        assert torch.equal(logits.next_token_logits, eager_logits.next_token_logits)
        assert torch.equal(sample.next_token_ids, eager_sample.next_token_ids)
    finally:
        runner.cuda_graph_runner = None
        cleanup()


# ------------------------------------------------------------------------------------- argmax in the graph
def _info(**kw):
    params = [SamplingParams(temperature=0.0), SamplingParams(**{"temperature": 0.0, **kw})]
    for p in params:
        p.normalize(None)
    return SamplingBatchInfo.from_reqs(params, "cpu", VOCAB, [[], []], input_ids=[[1, 2], [3]])


def test_graph_greedy_eligible_only_for_plain_greedy_batches():
    batch = _decode_batch(2)
    batch.sampling_info = _info()
    assert graph_greedy_eligible(batch)
    batch.return_logprob = True
    assert not graph_greedy_eligible(batch)
    for kw in (dict(temperature=0.7), dict(frequency_penalty=0.5), dict(presence_penalty=0.5),
               dict(repetition_penalty=1.2), dict(min_new_tokens=3, stop_token_ids=[7]), dict(logit_bias={"3": 2.0})):
        b = _decode_batch(2)
        b.sampling_info = _info(**kw)
        assert not graph_greedy_eligible(b), kw
    b = _decode_batch(2)
    b.sampling_info = _info()
    b.sampling_info.vocab_mask = torch.full((2, 2), -1, dtype=torch.int32)
    assert not graph_greedy_eligible(b)
    b.sampling_info = _info()
    b.sampling_info.custom_logit_processors = [None, "x"]
    assert not graph_greedy_eligible(b)
    assert not graph_greedy_eligible(_decode_batch(2))  # no sampling info


class _GreedyFakeGraphs(_FakeGraphs):
    """Replays "the graph" eagerly: like a capture, the argmax of the padded batch's logits (the real rows plus two
    padding rows: padded size 4) sits in a static buffer read through CudaGraphRunner.greedy_ids."""

    def __init__(self, logits):
        super().__init__(logits, runs=True)
        self.graph = _bare_graph_runner(4)
        self.graph.batch_sizes = [1, 4]
        padded = torch.cat([logits, torch.randn(2, logits.shape[1])])
        self.graph.greedy_outputs = {4: torch.argmax(padded, dim=-1)}

    def greedy_ids(self, batch, padded=None):
        return CudaGraphRunner.greedy_ids(self.graph, batch, padded)


def test_forward_takes_graph_greedy_ids_and_equals_the_sampler(runner, gen, monkeypatch):
    """With the graph's argmax (always captured) and an all-greedy batch, ModelRunner.forward returns
    those ids without calling the sampler, and they equal the sampler's ids on the same logits (the eager path);
    for a batch that asks for logprobs the sampler runs as before."""
    batch, cleanup = _prefill_then_decode(runner, gen)
    try:
        eager_logits, eager_sample = runner.forward(batch)
        runner.cuda_graph_runner = _GreedyFakeGraphs(eager_logits.next_token_logits.clone())
        calls = []
        real = runner.sampler.forward
        monkeypatch.setattr(runner.sampler, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
        logits, sample = runner.forward(batch)
        assert calls == []
        assert torch.equal(sample.next_token_ids, eager_sample.next_token_ids)
        assert sample.next_token_ids.dtype == torch.int64 and sample.logprobs is None
        batch.return_logprob = True
        logits, sample = runner.forward(batch)
        assert len(calls) == 1 and sample.logprobs is not None
        assert torch.equal(sample.next_token_ids, eager_sample.next_token_ids)
    finally:
        runner.cuda_graph_runner = None
        cleanup()


@pytest.mark.parametrize("loc_as_list", [False, True])
def test_decode_input_stager_packs_rows_and_padding(gen, loc_as_list):
    """DecodeInputStager (one packed copy per replay): columns [:bs] hold the batch, [bs:padded] the padding
    (token 0, position 0, the pad row, seq_len 1, KV slot 0), for batches of changing size through alternating host
    buffers; it equals the legacy staging on the same batches; bad sizes raise."""
    from sglang.srt.model_executor.graph_inputs import DecodeInputStager, stage_decode_inputs_legacy

    st = DecodeInputStager(16, 7, "cpu")
    legacy_static = torch.zeros(5, 16, dtype=torch.int64)
    legacy_pad = torch.tensor([[0], [0], [7], [1]], dtype=torch.int64).expand(4, 16).contiguous()
    for bs, padded in ((5, 8), (16, 16), (1, 1), (3, 4)):
        b = _decode_batch(bs, rows=torch.randint(0, 9, (bs,), generator=gen).tolist())
        b.input_ids = torch.randint(0, VOCAB, (bs,), generator=gen).tolist()
        b.positions = torch.randint(0, 50, (bs,), generator=gen).tolist()
        b.seq_lens = [p + 1 for p in b.positions]
        b.out_cache_loc = torch.randint(1, 999, (bs,), generator=gen)
        if loc_as_list:
            b.out_cache_loc = b.out_cache_loc.tolist()
        st.stage(b, padded)
        want = torch.tensor([b.input_ids, b.positions, b.req_pool_indices, b.seq_lens, list(b.out_cache_loc)])
        assert torch.equal(st.static[:, :bs], want)
        pad = torch.tensor([[0], [0], [7], [1], [0]]).expand(5, padded - bs)
        assert torch.equal(st.static[:, bs:padded], pad)
        if not loc_as_list:
            stage_decode_inputs_legacy(legacy_static, legacy_pad, b, padded)
            assert torch.equal(legacy_static[:, :padded], st.static[:, :padded])
    ids, pos, rows, seq, loc = st.views()
    assert ids.data_ptr() == st.static.data_ptr() and loc.shape == (16,)
    with pytest.raises(ValueError, match="padded"):
        st.stage(_decode_batch(5), 4)
    with pytest.raises(ValueError, match="max_bs"):
        DecodeInputStager(0, 0, "cpu")


# ------------------------------------------------------------------------------------- layers -> ops
def _spy(monkeypatch, name: str) -> list:
    calls = []
    real = getattr(ops, name)

    def wrapper(*a, **k):
        calls.append(name)
        return real(*a, **k)

    monkeypatch.setattr(ops, name, wrapper)
    return calls


def test_layers_call_ops_and_keep_cpu_references_bit_exact(monkeypatch, gen):
    calls = []
    for name in ("rmsnorm", "silu_and_mul", "fused_topk", "fused_moe"):
        calls += [_spy(monkeypatch, name)]
    x = torch.randn(6, 16, generator=gen).to(torch.bfloat16)
    res = torch.randn(6, 16, generator=gen).to(torch.bfloat16)
    norm = RMSNorm(16, 1e-5, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(16, generator=gen))
    assert torch.equal(norm(x), rmsnorm_ref(x, norm.weight, 1e-5))
    x0, r0 = x.clone(), res.clone()
    y, s = norm(x, res)
    ry, rs = rmsnorm_ref(x0, norm.weight, 1e-5, r0)
    assert torch.equal(y, ry) and torch.equal(s, rs)
    assert torch.equal(x, x0) and torch.equal(res, r0)  # CPU: inputs are not overwritten
    h = torch.randn(5, 12, generator=gen)
    assert torch.equal(SiluAndMul()(h), silu_and_mul_ref(h))
    moe = FusedMoE(4, 2, 8, 6, renormalize=True)
    with torch.no_grad():
        moe.w13_weight.copy_(torch.randn(moe.w13_weight.shape, generator=gen))
        moe.w2_weight.copy_(torch.randn(moe.w2_weight.shape, generator=gen))
    xm, lg = torch.randn(7, 8, generator=gen), torch.randn(7, 4, generator=gen)
    assert torch.equal(moe(xm, lg), fused_moe_ref(xm, moe.w13_weight, moe.w2_weight, *select_experts(lg, 2, True)))
    assert all(calls), calls  # every layer went through ops


# ------------------------------------------------------------------------------------- sampling-info reuse
def _reqs(n: int, **kw):
    from sglang.srt.managers.schedule_batch import Req

    out = []
    for i in range(n):
        p = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 8, **kw})
        p.normalize(None)
        out.append(Req(f"r{i}-{sorted(kw.items())}", [1, 2, 3], p, eos_token_ids=(2,)))
    return out


def test_make_sampling_info_reuses_step_independent_batches(runner):
    """The same requests in the same order get the same SamplingBatchInfo object while nothing in it depends on the
    step; its tensors equal a fresh build after tokens were generated; another order, another request set, or rows
    whose info depends on the generated tokens (penalties, seeds, min_new_tokens) rebuild it every time."""
    from sglang.srt.model_executor.model_runner import build_sampling_info

    reqs = _reqs(3)
    a = runner.make_sampling_info(reqs)
    reqs[0].output_ids.append(5)
    assert runner.make_sampling_info(reqs) is a
    fresh = build_sampling_info(reqs, runner.device, VOCAB)
    for name in ("temperatures", "top_ps", "top_ks", "min_ps", "greedy_mask"):
        assert torch.equal(getattr(a, name), getattr(fresh, name)), name
    assert a.is_all_greedy == fresh.is_all_greedy and not fresh.need_penalties
    assert runner.make_sampling_info(reqs[::-1]) is not a
    assert runner.make_sampling_info(reqs[:2]) is not a
    for kw in (dict(frequency_penalty=0.5), dict(temperature=0.7, seed=3), dict(min_new_tokens=4)):
        r = _reqs(2, **kw)
        first = runner.make_sampling_info(r)
        r[0].output_ids.append(7)
        second = runner.make_sampling_info(r)
        assert second is not first, kw
        assert second.num_generated == [1, 0], kw
