"""The benchmark records that ``--record-dir`` makes ``benchmark/decode/attention_rope_kernels.py`` and
``benchmark/decode/gemm_tune.py`` write (both need a GPU to measure), built on CPU from synthetic results: each
validates, carries its same-run baseline, the ratios computed from the inputs, the copy-bandwidth floor and a
headline, and renders as markdown."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmark.common import records  # noqa: E402

FAKE_ENV = {"git_commit": "0" * 40, "git_dirty": False, "date": "2026-12-07T12:00:00+00:00",
            "gpu": {"model": "NVIDIA H100 80GB HBM3", "count": 1, "driver": "x"}, "platform": "test",
            "versions": {"python": "3", "torch": None, "cuda": None, "nccl": None, "triton": None}}


def test_attention_rope_kernels_record(tmp_path):
    """Rows as attention_rows / rope_kv_rows / gemm_rows / sampling_rows append them: speedup = baseline / time,
    over_floor = time / HBM floor, a failed config kept with its error; headline at the largest batch / token count."""
    from benchmark.decode import attention_rope_kernels as ark

    bw = 3.0e12
    rows: list = []
    for bs, legacy, new in ((1, 20.0, 12.0), (128, 400.0, 250.0)):
        kv_floor = 2 * bs * 1024 * ark.NKV * ark.HD * 2 / bw * 1e6
        ark._add(rows, "decode_attention", bs, "legacy kernel, legacy rule (splits=8)", legacy,
                 "legacy kernel, legacy rule", legacy, kv_floor)
        ark._add(rows, "decode_attention", bs, "new kernel, wave rule (splits=4)", new, "legacy kernel, legacy rule",
                 legacy, kv_floor)
        ark._add(rows, "decode_attention", bs, "BLOCK_N=128 warps=8", None, "legacy kernel, legacy rule", legacy,
                 kv_floor, error="failed: OutOfResources")
    for n, unfused, fused in ((1, 30.0, 10.0), (128, 45.0, 15.0)):
        ark._add(rows, "rope_kv_store", n, "fused RoPE + KV store", fused, "unfused: RoPE + v.contiguous + 2 index_put",
                 unfused)
    ark._add(rows, "gemm", 16, "o_proj 4096x4096, skinny (16, 512, 4, 4)", 14.0, "cuBLAS F.linear", 18.0,
             4096 * 4096 * 2 / bw * 1e6, max_rel_err=2e-3)
    ark._add(rows, "sampling_columns", 32, "one packed copy (host us)", 9.0, "five pinned copies", 40.0)
    rec = ark.kernels_record(rows, bw, {"context": 1024, "batches": [1, 128]}, env=FAKE_ENV,
                             command="python benchmark/decode/attention_rope_kernels.py")
    js, md = records.write_record(rec, tmp_path)
    rec = records.load_record(js)
    assert js.name == "2026-12-07_decode_attention_rope_kernels_h100.json" and rec["mode"] == "attention-kernels"
    assert rec["baselines"] == ["baseline_us"] and rec["floor"]["column"] == "floor_us"
    new128 = [r for r in rec["rows"] if r["size"] == 128 and r["case"].startswith("new kernel")][0]
    floor128 = 2 * 128 * 1024 * ark.NKV * ark.HD * 2 / bw * 1e6
    assert new128["speedup"] == round(400.0 / 250.0, 3) and new128["over_floor"] == round(250.0 / floor128, 3)
    failed = [r for r in rec["rows"] if r.get("error")]
    assert len(failed) == 2 and all(r["speedup"] is None for r in failed)
    gemm = [r for r in rec["rows"] if r["section"] == "gemm"][0]
    assert gemm["speedup"] == round(18.0 / 14.0, 3) and gemm["max_rel_err"] == 2e-3
    sampling = [r for r in rec["rows"] if r["section"] == "sampling_columns"][0]
    assert sampling["speedup"] == round(40.0 / 9.0, 3) and sampling["floor_us"] is None
    attn, rope = rec["headline"]
    assert (attn["value"], attn["baseline"], attn["ratio"]) == (250.0, 400.0, round(400.0 / 250.0, 3))
    assert "batch 128" in attn["label"] and (rope["ratio"], rope["value"]) == (round(45.0 / 15.0, 3), 15.0)
    assert "new tokens 128" in rope["label"]
    assert "| section | size |" in md.read_text() and "Headline:" in records.render_markdown(rec)


def test_gemm_tune_record(tmp_path):
    """The autotune table as rows per (shape, M) plus one decode-step row per M: cuBLAS as the baseline, the chosen
    path's speed-up, the copy-bandwidth floor and the ratios to it, as render() computes them."""
    from benchmark.decode.gemm_tune import tune_record
    from sgl_kernel.triton.skinny_gemm import SkinnyConfig

    from sglang.srt.layers.decode_gemm import DecodeGemmTable, GemmChoice

    cfg = SkinnyConfig(block_n=16, block_k=512)
    table = DecodeGemmTable(device_name="NVIDIA H100 80GB HBM3", tune_s=12.5, entries=(
        ((4096, 4096, "bfloat16"), (GemmChoice(1, cfg, 20.0, 15.0, cfg), GemmChoice(16, None, 22.0, 25.0, cfg))),
        ((128256, 4096, "bfloat16"), (GemmChoice(1, None, 400.0, None, None),
                                      GemmChoice(16, cfg, 420.0, 390.0, cfg)))))
    names = {(4096, 4096, "bfloat16"): ("o_proj", 32), (128256, 4096, "bfloat16"): ("lm_head", 1)}
    bw = 3.0e12
    rec = tune_record(table, names, bw, {"model_path": "cfg", "batches": [1, 16]}, env=FAKE_ENV,
                      command="python benchmark/decode/gemm_tune.py")
    js, md = records.write_record(rec, tmp_path)
    rec = records.load_record(js)
    assert js.name == "2026-12-07_decode_gemm_tune_h100.json" and rec["baselines"] == ["cublas_us"]
    o1, o16, lm1, lm16, step1, step16 = rec["rows"]
    assert (o1["chosen"], o1["chosen_us"], o1["speedup"]) == ("skinny", 15.0, round(20.0 / 15.0, 3))
    assert (o16["chosen"], o16["speedup"]) == ("cuBLAS", 1.0) and lm1["skinny_us"] is None
    floor_o1 = 2 * (4096 * 4096 + 1 * (4096 + 4096)) / bw * 1e6
    assert o1["floor_us"] == pytest.approx(floor_o1) and o1["chosen_over_floor"] == round(15.0 / floor_o1, 3)
    floor_lm16 = 2 * (128256 * 4096 + 16 * (128256 + 4096)) / bw * 1e6
    assert lm16["cublas_over_floor"] == round(420.0 / floor_lm16, 3)
    assert step1["shape"] == "decode step (all GEMMs)" and step1["m"] == 1
    cub16, tuned16 = 22.0 * 32 + 420.0, 22.0 * 32 + 390.0  # o_proj x 32 layers (cuBLAS chosen) + the LM head once
    assert step16["cublas_us"] == pytest.approx(cub16) and step16["chosen_us"] == pytest.approx(tuned16)
    assert step16["speedup"] == round(cub16 / tuned16, 3)
    vs_cublas, vs_floor = rec["headline"]
    assert (vs_cublas["value"], vs_cublas["baseline"]) == (round(tuned16 / 1e3, 4), round(cub16 / 1e3, 4))
    assert vs_cublas["ratio"] == step16["speedup"] and vs_floor["ratio"] == step16["chosen_over_floor"]
    assert rec["params"]["tune_s"] == 12.5 and "| shape | n | k | m |" in md.read_text()
    assert records.render_markdown(rec).startswith("# benchmark.decode.bench --mode gemm-tune")


def _step_ab_json(folder, decode, serving):
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "decode_step_ab.json").write_text(json.dumps({"decode": decode, "serving": serving}))


def test_gemm_tune_ab_record_and_cpu_run(tmp_path):
    """--ab-off/--ab-on (no GPU): the rows of two step_ab.py results with autotune off as the baseline, on / off and
    each side over its floor; a row only one side has is kept without ratios; the headline is the served step at the
    largest batch. The CLI run with --record-dir writes the same record next to its markdown."""
    from benchmark.decode import gemm_tune

    off, on = tmp_path / "off", tmp_path / "on"
    _step_ab_json(off, [{"batch": 1, "replay_ms": 7.1, "step_ms": 7.4, "floor_ms": 5.5},
                        {"batch": 32, "replay_ms": 8.0, "step_ms": 8.3, "floor_ms": 6.0}],
                  [{"batch": 1, "mode": "overlap", "step_ms": 7.9, "floor_ms": 5.5},
                   {"batch": 32, "mode": "overlap", "step_ms": 8.9, "floor_ms": 6.0}])
    _step_ab_json(on, [{"batch": 1, "replay_ms": 6.5, "step_ms": 6.9, "floor_ms": 5.4},
                       {"batch": 32, "replay_ms": 7.6, "step_ms": 7.9, "floor_ms": 6.1}],
                  [{"batch": 32, "mode": "overlap", "step_ms": 8.4, "floor_ms": 6.1}])
    rec = gemm_tune.ab_record(gemm_tune.ab_rows(off, on), {"ab_off": str(off), "ab_on": str(on)}, env=FAKE_ENV,
                              command="python benchmark/decode/gemm_tune.py --ab-off off --ab-on on")
    js, md = records.write_record(rec, tmp_path / "rec")
    rec = records.load_record(js)
    assert js.name == "2026-12-07_decode_gemm_tune_ab_h100.json" and rec["baselines"] == ["off_ms"]
    by = {(r["batch"], r["row"]): r for r in rec["rows"]}
    assert len(by) == 6 and by[(1, "served step (overlap)")]["on_ms"] is None
    assert by[(1, "served step (overlap)")]["on_vs_off"] is None
    served = by[(32, "served step (overlap)")]
    assert served["on_vs_off"] == round(8.4 / 8.9, 3) and served["on_over_floor"] == round(8.4 / 6.1, 3)
    assert by[(1, "graph replay")]["off_over_floor"] == round(7.1 / 5.5, 3)
    (h,) = rec["headline"]
    assert (h["value"], h["baseline"], h["ratio"]) == (8.4, 8.9, round(8.4 / 8.9, 3)) and "batch 32" in h["label"]
    assert "| batch | row |" in md.read_text() and "Headline:" in records.render_markdown(rec)

    out = tmp_path / "out"
    assert gemm_tune.main(["--out", str(out), "--ab-off", str(off), "--ab-on", str(on), "--record-dir",
                           str(tmp_path / "cli")]) == 0
    (cli,) = (tmp_path / "cli" / "decode").glob("*_decode_gemm_tune_ab_*.json")
    cli = records.load_record(cli)
    assert [r["on_vs_off"] for r in cli["rows"]] == [r["on_vs_off"] for r in rec["rows"]]
    assert "| 32 | served step (overlap) | 8.900 | 8.400 |" in (out / "decode_gemm_tune.md").read_text()
