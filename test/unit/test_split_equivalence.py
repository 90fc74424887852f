"""Engine seams: a batch split by tokens at every boundary, or by requests into m micro-batches, gives the
same logits as the unsplit batch, for every architecture (MoE included), with a cached prefix, chunked
prefill (a request extending its own earlier chunk) and decodes in one mixed batch."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
transformers = pytest.importorskip("transformers")

from model_harness import ModelHarness, randomize_weights  # noqa: E402
from test_models_vs_hf import COMMON, CASES, VOCAB  # noqa: E402

from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.model_executor.executors import MicroBatchExecutor, TokenSplitExecutor, create_executor  # noqa: E402
from sglang.srt.model_loader.loader import load_model  # noqa: E402

TOL = 2e-5


@pytest.fixture(scope="module", params=sorted(CASES))
def model(request, tmp_path_factory):
    cfg_cls, model_cls, extra = CASES[request.param]
    cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).float().eval()
    randomize_weights(hf, seed=7 + sum(map(ord, request.param)))
    path = str(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(path)
    config = ModelConfig.from_path(path)
    return load_model(config, "auto", "cpu"), config


def _mixed_batch(h: ModelHarness, seed: int):
    """A MIXED batch: a decodes, b continues a chunked prefill (prefix = its earlier chunk), c decodes, d is a
    fresh prefill whose first 4 tokens hit a prefix shared with a (copied req_to_token rows: a radix hit)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    h.step([("a", rand(7)), ("b", rand(5)), ("c", rand(3))])
    h.adopt_prefix("d", "a", 4)
    fb = h.prepare([("a", rand(1)), ("b", rand(6)), ("c", rand(1)), ("d", rand(5))])
    assert fb.forward_mode == ForwardMode.MIXED and fb.prefix_lens_cpu == [7, 5, 3, 4]
    return fb


def test_token_split_every_boundary_equals_unsplit(model):
    m, config = model
    h = ModelHarness(m, config)
    fb = _mixed_batch(h, 11)
    ref = h.run(fb)
    assert ref.abs().max() > 0.1
    for cut in range(1, fb.num_tokens):
        out = h.run(fb, TokenSplitExecutor(lambda n, c=cut: c))
        diff = (out - ref).abs().max().item()
        assert diff < TOL, f"token split at {cut}/{fb.num_tokens}: max diff {diff:.3g}"


@pytest.mark.parametrize("m", [2, 3, 4])
def test_request_micro_batches_equal_unsplit(model, m):
    mdl, config = model
    h = ModelHarness(mdl, config)
    fb = _mixed_batch(h, 12 + m)
    ref = h.run(fb)
    out = h.run(fb, MicroBatchExecutor(m))
    assert (out - ref).abs().max().item() < TOL


def test_prefill_only_and_decode_only_batches_split(model):
    mdl, config = model
    h = ModelHarness(mdl, config)
    gen = torch.Generator().manual_seed(5)
    fb = h.prepare([("p", torch.randint(0, VOCAB, (9,), generator=gen).tolist()),
                    ("q", torch.randint(0, VOCAB, (4,), generator=gen).tolist())])
    assert fb.forward_mode == ForwardMode.EXTEND
    ref = h.run(fb)
    for cut in (1, 5, 9, 12):
        assert (h.run(fb, TokenSplitExecutor(lambda n, c=cut: c)) - ref).abs().max() < TOL
    fb = h.prepare([("p", [3]), ("q", [4])])
    assert fb.forward_mode == ForwardMode.DECODE
    ref = h.run(fb)
    assert (h.run(fb, TokenSplitExecutor()) - ref).abs().max() < TOL
    assert (h.run(fb, MicroBatchExecutor(2)) - ref).abs().max() < TOL


def test_two_live_batches_on_one_backend(model):
    """Metadata lives on each ForwardBatch: preparing two batches' metadata, then running both, equals running
    them one after the other."""
    mdl, config = model
    gen = torch.Generator().manual_seed(9)
    toks = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (6, 3, 8)]

    def fresh():
        h = ModelHarness(mdl, config)
        fb1 = h.prepare([("x", toks[0]), ("y", toks[1])])
        fb2 = h.prepare([("z", toks[2])])
        return h, fb1, fb2

    h, fb1, fb2 = fresh()
    seq1, seq2 = h.run(fb1), h.run(fb2)
    h, fb1, fb2 = fresh()
    backend = h.backend
    backend.init_forward_metadata(fb1)
    backend.init_forward_metadata(fb2)
    with torch.inference_mode():
        live2 = mdl(fb2.input_ids, fb2.positions, fb2).next_token_logits
        live1 = mdl(fb1.input_ids, fb1.positions, fb1).next_token_logits
    assert torch.allclose(live1, seq1, atol=TOL) and torch.allclose(live2, seq2, atol=TOL)


def test_split_bookkeeping_straddling_request():
    """A cut inside a request: its second part is an extend over the first part (prefix grows, seq stays)."""
    h = ModelHarness.__new__(ModelHarness)  # only the batch builder is used
    from sglang.srt.forward_batch_info import ForwardBatch, ModelWorkerBatch

    mwb = ModelWorkerBatch(forward_mode=ForwardMode.MIXED, input_ids=list(range(10)), positions=[4, 5, 6, 7, 8, 2, 0, 1, 2, 3],
                           out_cache_loc=torch.arange(10, 20), req_pool_indices=[3, 1, 2], prefix_lens=[4, 2, 0],
                           extend_lens=[5, 1, 4], seq_lens=[9, 3, 4], sample=[True] * 3)
    fb = ForwardBatch.init_new(mwb, torch.device("cpu"), None, None, TorchNativeAttnBackend())
    a, b = fb.split_tokens(3)
    assert (a.req_pool_indices_cpu, a.prefix_lens_cpu, a.extend_lens_cpu, a.seq_lens_cpu) == ([3], [4], [3], [7])
    assert (b.req_pool_indices_cpu, b.prefix_lens_cpu, b.extend_lens_cpu, b.seq_lens_cpu) == \
        ([3, 1, 2], [7, 2, 0], [2, 1, 4], [9, 3, 4])
    assert b.extend_start_loc.tolist() == [0, 2, 3] and b.out_cache_loc.tolist() == list(range(13, 20))
    assert b.token_range == (3, 10) and b.positions.tolist() == [7, 8, 2, 0, 1, 2, 3]
    mbs = fb.split_requests(2)
    assert [x.req_pool_indices_cpu for x in mbs] == [[3, 1], [2]] and [x.token_range for x in mbs] == [(0, 6), (6, 10)]
    for bad in (0, 10):
        with pytest.raises(ValueError, match="boundary"):
            fb.split_tokens(bad)
    with pytest.raises(ValueError, match="num_micro_batches"):
        fb.split_requests(4)
    with pytest.raises(ValueError, match="unknown executor"):
        create_executor("nope")
    del h
