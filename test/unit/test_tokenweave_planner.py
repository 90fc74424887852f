"""TokenWeave's wave-aware split planner against a brute-force search over every cut; the executor's decision log
and its host-sync-free path."""

from __future__ import annotations

import random

import pytest

from sglang.srt.tokenweave.planner import GemmShape, layer_gemm_widths, plan_split, total_waves


def brute(tokens, widths, shape, max_skew=None):
    """(extra waves, |2 T1 - T|) of the best cut over every T1 within the skew window (the half always allowed)."""
    whole = total_waves(shape, tokens, widths)
    window = tokens if max_skew is None else int(max_skew * tokens)
    best = min(((total_waves(shape, t, widths) + total_waves(shape, tokens - t, widths) - whole, abs(2 * t - tokens))
                for t in range(1, tokens) if abs(2 * t - tokens) <= 2 * window or t == tokens // 2))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_skew", [None, 0.125, 0.0])
def test_plan_matches_brute_force(seed, max_skew):
    rng = random.Random(seed)
    shape = GemmShape(tile_m=rng.choice([64, 128, 256]), tile_n=rng.choice([64, 128, 256]),
                      num_sms=rng.choice([78, 108, 132]))
    widths = layer_gemm_widths(rng.choice([4096, 8192]), 64, 8, 128, rng.choice([14336, 28672]), rng.choice([1, 2, 8]))
    for _ in range(40):
        t = rng.randrange(2, 9000)
        plan = plan_split(t, widths, shape, max_skew)
        assert plan.prefix + plan.suffix == t and plan.prefix >= 1 and plan.suffix >= 1
        extra = total_waves(shape, plan.prefix, widths) + total_waves(shape, plan.suffix, widths) - plan.unsplit_waves
        assert plan.extra_waves == extra
        assert (extra, abs(2 * plan.prefix - t)) == brute(t, widths, shape, max_skew), (t, plan)
        if max_skew is not None:
            assert abs(2 * plan.prefix - t) <= 2 * int(max_skew * t) or plan.prefix == t // 2, (t, plan)


def test_split_stays_balanced_at_4096_on_116_sms():
    """4 x H200, TP4, Llama-3.3-70B (GEMMs capped to 116 SMs): the unbounded wave search cut 4096 tokens
    384 + 3712, which left the suffix's AllReduce with nothing to hide behind; the bounded planner cuts at the half
    (one extra wave), and at equal balance gives the prefix the larger part (1024: 640 + 384)."""
    shape = GemmShape(128, 128, 116)
    widths = layer_gemm_widths(8192, 64, 8, 128, 28672, tp_size=4)
    legacy = plan_split(4096, widths, shape, max_skew=None)
    assert (legacy.prefix, legacy.extra_waves) == (384, 0)
    plan = plan_split(4096, widths, shape)
    assert (plan.prefix, plan.suffix, plan.extra_waves) == (2048, 2048, 1)
    assert plan_split(1024, widths, shape).prefix == 640 and plan_split(1024, widths, shape, None).prefix == 384
    for t in (1024, 2048, 4096, 8192, 16384):
        p = plan_split(t, widths, shape)
        assert 3 * t // 8 <= p.prefix <= 5 * t // 8 and p.prefix >= p.suffix, (t, p)


def test_smart_split_beats_the_naive_half():
    """Llama-3.3-70B TP8 layer GEMMs on an H100-class GPU: the naive half split adds waves that the planner's
    cut avoids (all of them at 1920 tokens; at 1152, 3 of 5 within the balance window, 4 of 5 by the unbounded
    search, which cuts 256 + 896)."""
    shape = GemmShape(128, 128, 132)
    widths = layer_gemm_widths(8192, 64, 8, 128, 28672, tp_size=8)
    for t, want, skew in ((1920, 0, 0.125), (1152, 2, 0.125), (1152, 1, None)):
        naive = total_waves(shape, t // 2, widths) * 2 - total_waves(shape, t, widths)
        plan = plan_split(t, widths, shape, skew)
        assert plan.extra_waves == want < naive and plan.prefix % 128 == 0


def test_bad_input():
    with pytest.raises(ValueError, match="cannot be split"):
        plan_split(1, (128,))
    with pytest.raises(ValueError, match="positive"):
        GemmShape(0, 128, 132)
    with pytest.raises(ValueError, match="no GEMM widths"):
        plan_split(10, ())
    for bad in (-0.1, 0.6):
        with pytest.raises(ValueError, match="max_skew"):
            plan_split(10, (128,), max_skew=bad)


def test_executor_decisions_logged_once_per_batch_size(caplog):
    """The executor logs each (batch size, split or not) decision once: decode batches and batches below
    --tokenweave-min-tokens run unsplit, larger prefill batches get the planner's cut."""
    import logging

    import torch

    from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor

    def batch(mode, extend_lens):
        n = sum(extend_lens)
        prefix = [3 if mode == ForwardMode.DECODE else 0] * len(extend_lens)
        mwb = ModelWorkerBatch(forward_mode=mode, input_ids=list(range(n)), positions=list(range(n)),
                               out_cache_loc=torch.arange(n), req_pool_indices=list(range(len(extend_lens))),
                               prefix_lens=prefix, extend_lens=extend_lens,
                               seq_lens=[p + e for p, e in zip(prefix, extend_lens)], sample=[True] * len(extend_lens))
        return ForwardBatch.init_new(mwb, torch.device("cpu"), None, None, TorchNativeAttnBackend())

    ex = TokenWeaveExecutor(TokenWeaveConfig(min_tokens=6, gemm_widths=(256, 128, 512, 128),
                                             gemm_shape=GemmShape(4, 128, 8)), torch.device("cpu"))
    decode, small, big = batch(ForwardMode.DECODE, [1] * 7), batch(ForwardMode.EXTEND, [5]), \
        batch(ForwardMode.EXTEND, [4, 3])
    with caplog.at_level(logging.INFO, logger="sglang.srt.tokenweave.executor"):
        for _ in range(3):
            assert [len(ex.plan(b)) for b in (decode, small, big)] == [1, 1, 2]
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang.srt.tokenweave.executor"]
    assert len(lines) == 3, lines
    assert sorted(line.split(" tokens ")[1].split(" ")[0] for line in lines) == ["run", "run", "split"], lines
    assert any(line.startswith("TokenWeave: 7 tokens split ") for line in lines)
    assert any(line.startswith("TokenWeave: 7 tokens run unsplit") for line in lines)


def test_executor_path_has_no_host_sync(monkeypatch, tmp_path):
    """TokenWeave's executor (planning, splitting, per-split metadata, every layer stage of a dense model, final
    norm and logits) never reads a tensor back to the host (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
    ``torch.cuda.synchronize``): on a GPU that would stall the two streams. CPU proxy of the CUDA path; the MoE
    experts' CPU reference is excluded (the GPU path runs the Triton kernel), so the model here is dense."""
    import os
    import sys

    import torch

    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, os.path.dirname(__file__))
    from model_harness import ModelHarness, randomize_weights

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model
    from sglang.srt.tokenweave import gemm_widths_of
    from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor

    cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    hf = transformers.Qwen2ForCausalLM(cfg).float().eval()
    randomize_weights(hf, 5)
    hf.save_pretrained(str(tmp_path))
    config = ModelConfig.from_path(str(tmp_path))
    model = load_model(config, "auto", "cpu")
    h = ModelHarness(model, config)
    h.step([("a", list(range(5))), ("b", list(range(7)))])
    fb = h.prepare([("a", [3]), ("b", list(range(9))), ("c", list(range(6)))])  # mixed: decode, chunk, prefill
    ref = h.run(fb)
    ex = TokenWeaveExecutor(TokenWeaveConfig(min_tokens=2, gemm_widths=gemm_widths_of(config, 1)), torch.device("cpu"))
    syncs = []

    def recorder(name, orig):
        def call(*a, **k):
            syncs.append(name)
            return orig(*a, **k)
        return call

    h.poison_kv(fb)
    for name in ("item", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, recorder(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", recorder("synchronize", torch.cuda.synchronize))
    with torch.inference_mode():
        out = ex.run(model, fb).next_token_logits
    monkeypatch.undo()
    assert not syncs, f"host syncs in the TokenWeave path: {syncs}"
    assert (out - ref).abs().max().item() < 2e-5


def test_old_and_new_split_give_the_same_logits(tmp_path):
    """The balanced planner changes only where the batch is cut, never the result: a mixed batch of 16
    tokens (decode + chunk + prefill) that the legacy planner cuts 4 + 12 and the bounded one 8 + 8 gives the
    single-process logits either way (CPU, fp32); ``set_split_skew`` switches the planner and rejects bad values."""
    import os
    import sys

    import torch

    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, os.path.dirname(__file__))
    from model_harness import ModelHarness, randomize_weights

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model
    from sglang.srt.tokenweave import gemm_widths_of
    from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor

    cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    hf = transformers.Qwen2ForCausalLM(cfg).float().eval()
    randomize_weights(hf, 7)
    hf.save_pretrained(str(tmp_path))
    config = ModelConfig.from_path(str(tmp_path))
    model = load_model(config, "auto", "cpu")
    h = ModelHarness(model, config)
    h.step([("a", list(range(5))), ("b", list(range(7)))])
    fb = h.prepare([("a", [3]), ("b", list(range(9))), ("c", list(range(6)))])
    ref = h.run(fb)
    ex = TokenWeaveExecutor(TokenWeaveConfig(min_tokens=2, gemm_widths=gemm_widths_of(config, 1),
                                             gemm_shape=GemmShape(4, 64, 3), gemm_carveout=0), torch.device("cpu"))
    outs = {}
    for skew, prefix in ((None, 4), (0.125, 8)):
        ex.set_split_skew(skew)
        assert [s.num_tokens for s in ex.plan(fb)] == [prefix, 16 - prefix]
        h.poison_kv(fb)
        with torch.inference_mode():
            outs[skew] = ex.run(model, fb).next_token_logits
        assert (outs[skew] - ref).abs().max().item() < 2e-5, skew
    with pytest.raises(ValueError, match="split_skew"):
        ex.set_split_skew(0.7)
    with pytest.raises(ValueError, match="split_skew"):
        TokenWeaveConfig(gemm_widths=(64,), split_skew=-0.1)
