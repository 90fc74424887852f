"""The TokenWeave benchmark runs on CPU (smoke mode): the layer table has every variant for every token count
with ratios, and the end-to-end mode reports TokenWeave on/off throughput from real bench_offline_throughput
runs and bench_serving runs against launch_server, at TP 2 (gloo). Times are not checked (they mean nothing on CPU)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *args) -> str:
    cmd = [sys.executable, str(ROOT / "benchmark" / "tokenweave" / "bench_layer.py"), "--smoke", "--results-dir",
           str(tmp_path), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    files = list(tmp_path.glob("*_tokenweave_*_smoke.md"))
    assert len(files) == 1, files
    text = files[0].read_text()
    assert "- date: " in text and "- hardware: " in text and "- command: " in text
    return text


def test_layer_mode_smoke(tmp_path):
    """Two real model shapes (dense Llama-3.3-70B, MoE Mixtral-8x22B; shrunk in smoke mode) in one table."""
    from conftest import shared_path

    models = [shared_path("configs", "meta-llama--Llama-3.3-70B-Instruct"),
              shared_path("configs", "mistralai--Mixtral-8x22B-v0.1")]
    text = _run(tmp_path, "--tokens", "16", "40", "--model-path", *models, "--overlap-tokens", "16",
                "--host-profile", "40", "--record-dir", str(tmp_path / "rec"))
    sys.path.insert(0, str(ROOT))
    from benchmark.common.records import load_record

    (rec,) = [load_record(f) for f in (tmp_path / "rec" / "tokenweave").glob("*_tokenweave_layer_cpu.json")]
    assert len(rec["rows"]) == 4 and len(rec["headline"]) == 2 and rec["baselines"][:2] == ["nocomm_ms", "nccl_ms"]
    # --host-profile: rank 0's cProfile of one forward per variant and model; the eager logits check vs nccl
    assert len(re.findall(r"^## host profile: (nocomm|nccl|tokenweave), T=40 ", text, re.M)) == 2 * 3, text
    assert re.search(r"^host [0-9.]+ ms under cProfile, \d+ Python calls", text, re.M)
    check = text.split("## correctness: eager next-token logits vs the nccl variant's")[1]
    assert re.search(r"^- T=16: tokenweave [0-9.e+-]+", check, re.M) and "- T=40: tokenweave" in check, check
    main_table, host_table = text.split("## host vs GPU time per forward")
    rows = [line for line in main_table.splitlines() if re.match(r"\| \S+ \| \d+ \| \d+ \|", line)]
    names = ("meta-llama--Llama-3.3-70B-Instruct", "mistralai--Mixtral-8x22B-v0.1")
    assert [tuple(c.strip() for c in r.split("|")[1:4]) for r in rows] == [(m, "2", t) for m in names
                                                                           for t in ("16", "40")]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert len(cells) == 8 and all(float(c) > 0 for c in cells[3:]), r  # 3 variants + 2 ratios, all measured
    host_rows = [line for line in host_table.splitlines() if re.match(r"\| \S+ \| 2 \| \d+ \| \w+ \|", line)]
    assert len(host_rows) == 2 * 2 * 3, host_table  # models x T x variants: GPU and host ms both measured
    assert all(float(c) > 0 for r in host_rows for c in r.strip("|").split("|")[4:6])
    assert host_table.count("- auto-off at T=16: TokenWeave ") == 2
    assert "supported --tokenweave-min-tokens" in host_table
    overlap = host_table.split("## communication / compute overlap")[1]  # CPU: the profiled forwards, no kernels
    assert len(re.findall(r"^\| (nocomm|nccl|tokenweave) \| 16 \| ", overlap, re.M)) == 2 * 3, overlap
    targets = host_table.split("## against the TokenWeave targets")[1]
    assert len(re.findall(r"^\| \S+ \| 2 \| (16|40) \| [0-9.]+ \| n/a \| [0-9.]+ \| <= 1.0 \|", targets, re.M)) == 4


def test_e2e_mode_smoke(tmp_path):
    """Offline throughput and bench_serving against launch_server, TokenWeave off and on, one table."""
    from conftest import shared_path

    model = shared_path("models", "stories260K")
    text = _run(tmp_path, "--e2e", "--model-path", model, "--num-prompts", "6", "--input-len", "24",
                "--output-len", "6")
    header = next(line for line in text.splitlines() if line.startswith("| TokenWeave |"))
    assert "offline" in header and "serving output_throughput" in header and "TTFT" in header, header
    rows = {m.group(1): [float(v) for v in m.group(2).split(" | ")]
            for m in re.finditer(r"^\| (off|on|on / off) \| ([0-9.| ]+) \|$", text, re.M)}
    assert set(rows) == {"off", "on", "on / off"} and all(len(r) == 3 for r in rows.values()), text
    assert all(v > 0 for r in rows.values() for v in r), text
    for i in range(3):
        assert rows["on / off"][i] == pytest.approx(rows["on"][i] / rows["off"][i], rel=0.01)


def _tokenweave_pair_run(tmp_path, shared_path, variant: str):
    """Layer mode at 16 tokens on the Llama-3.3-70B config with nccl, tokenweave and ``variant``: (the eager table's
    header line, the correctness section's text), after checking that the row has a positive time in every column."""
    model = shared_path("configs", "meta-llama--Llama-3.3-70B-Instruct")
    text = _run(tmp_path, "--tokens", "16", "--model-path", model, "--variants", "nccl", "tokenweave", variant)
    header = next(line for line in text.splitlines() if line.startswith("| model | TP | tokens | nccl ms"))
    row = next(line for line in text.splitlines() if re.match(r"\| \S+ \| 2 \| 16 \| [0-9.]+ \|", line))
    assert all(float(c) > 0 for c in row.strip("|").split("|")[3:]), row
    return header, text.split("## correctness: eager next-token logits vs the nccl variant's")[1]


def test_layer_mode_oldcomm_variant(tmp_path):
    """``tokenweave_oldcomm`` (TokenWeave on tw-comm with the bulk-copy two-shot forbidden) runs beside the default
    TokenWeave in the same run: its own column, the tokenweave / tokenweave_oldcomm ratio, and its eager logits in
    the correctness check against nccl."""
    from conftest import shared_path

    sys.path.insert(0, str(ROOT))
    from benchmark.tokenweave.layer_variants import OLDCOMM, ratio_pairs

    assert ratio_pairs(["nccl", "tokenweave", OLDCOMM]) == [("tokenweave", "nccl"), (OLDCOMM, "nccl"),
                                                            ("tokenweave", OLDCOMM)]
    assert ratio_pairs(["nccl", OLDCOMM]) == [(OLDCOMM, "nccl")]
    header, check = _tokenweave_pair_run(tmp_path, shared_path, OLDCOMM)
    assert "| tokenweave_oldcomm ms |" in header and "| tokenweave / tokenweave_oldcomm |" in header, header
    assert re.search(r"^- T=16: tokenweave [0-9.e+-]+, tokenweave_oldcomm [0-9.e+-]+", check, re.M), check


def test_layer_mode_oldsplit_variant(tmp_path):
    """``tokenweave_oldsplit`` (TokenWeave with the legacy unbounded split planner) runs beside the default
    TokenWeave in the same run: its own column, the oldsplit / nccl and tokenweave / tokenweave_oldsplit ratios, and
    its eager logits in the correctness check against nccl (equal to the default's at 16 tokens, where both planners
    cut at the half)."""
    from conftest import shared_path

    sys.path.insert(0, str(ROOT))
    from benchmark.tokenweave.layer_variants import OLDSPLIT, ratio_pairs

    assert ratio_pairs(["nccl", "tokenweave", OLDSPLIT]) == [("tokenweave", "nccl"), (OLDSPLIT, "nccl"),
                                                             ("tokenweave", OLDSPLIT)]
    header, check = _tokenweave_pair_run(tmp_path, shared_path, OLDSPLIT)
    assert "| tokenweave_oldsplit ms |" in header and "| tokenweave / tokenweave_oldsplit |" in header, header
    m = re.search(r"^- T=16: tokenweave ([0-9.e+-]+), tokenweave_oldsplit ([0-9.e+-]+)", check, re.M)
    assert m and float(m.group(1)) == float(m.group(2)), check


def test_layer_mode_full_residual_variant(tmp_path):
    """``tokenweave_full`` (TokenWeave with ``--tokenweave-full-residual``) runs beside the default TokenWeave (the
    sharded residual) in the same run: its own column, the full / nccl and tokenweave / tokenweave_full (sharded /
    full) ratios, and its eager logits equal to the sharded TokenWeave's (CPU fp32: the same reduce and norm per
    owned row) in the correctness check."""
    from conftest import shared_path

    sys.path.insert(0, str(ROOT))
    from benchmark.tokenweave.layer_variants import FULL, ratio_pairs

    assert ratio_pairs(["nccl", "tokenweave", FULL]) == [("tokenweave", "nccl"), (FULL, "nccl"),
                                                         ("tokenweave", FULL)]
    header, check = _tokenweave_pair_run(tmp_path, shared_path, FULL)
    assert "| tokenweave_full ms |" in header and "| tokenweave / tokenweave_full |" in header, header
    m = re.search(r"^- T=16: tokenweave ([0-9.e+-]+), tokenweave_full ([0-9.e+-]+)", check, re.M)
    assert m and float(m.group(1)) == float(m.group(2)), check


def test_layer_mode_selcarve_variant(tmp_path):
    """``tokenweave_selcarve`` (the GEMM SM carveout only on the GEMMs beside a comm) runs beside the default
    TokenWeave (every GEMM capped) in the same run: its own column, the selcarve / nccl and selcarve / tokenweave
    ratios, and eager logits equal to the default's (on CPU the carveout changes no arithmetic and both cut 16 tokens
    at the half)."""
    from conftest import shared_path

    sys.path.insert(0, str(ROOT))
    from benchmark.tokenweave.layer_variants import SELCARVE, ratio_pairs

    assert ratio_pairs(["nccl", "tokenweave", SELCARVE]) == [("tokenweave", "nccl"), (SELCARVE, "nccl"),
                                                             (SELCARVE, "tokenweave")]
    header, check = _tokenweave_pair_run(tmp_path, shared_path, SELCARVE)
    assert "| tokenweave_selcarve ms |" in header and "| tokenweave_selcarve / tokenweave |" in header, header
    m = re.search(r"^- T=16: tokenweave ([0-9.e+-]+), tokenweave_selcarve ([0-9.e+-]+)", check, re.M)
    assert m and float(m.group(1)) == float(m.group(2)), check


def _env():
    return {"git_commit": "abc", "git_dirty": False, "date": "2026-12-07T00:00:00+00:00",
            "gpu": {"model": "NVIDIA H200", "count": 8, "driver": None}, "versions": {"python": "3"}}


def test_layer_record_carries_baselines_ratios_headline(tmp_path):
    """--record-dir (layer mode): one row per (model, TP, T) with each variant's ms, the baselines named, the
    TokenWeave / baseline ratios, nocomm as the floor and TokenWeave vs NCCL at the largest T as the headline."""
    sys.path.insert(0, str(ROOT))
    from benchmark.common import records
    from benchmark.tokenweave.layer_report import layer_record

    variants = ["nocomm", "nccl", "nccl_symm", "tokenweave"]
    res = {"nocomm|1024": 1.0, "nccl|1024": 1.5, "nccl_symm|1024": 1.4, "tokenweave|1024": 1.6,
           "nocomm|4096": 4.0, "nccl|4096": 5.0, "nccl_symm|4096": 4.8, "tokenweave|4096": 4.5}
    rec = layer_record([("Llama-3.3-70B-Instruct", 4, res)], [1024, 4096], variants, params={"layers": 4},
                       gpu_count=4, env=_env(), command="python benchmark/tokenweave/bench_layer.py --tp 4")
    js, _ = records.write_record(rec, tmp_path)
    rec = records.load_record(js)
    assert js.name == "2026-12-07_tokenweave_layer_4xh200.json"
    assert rec["baselines"] == ["nocomm_ms", "nccl_ms", "nccl_symm_ms"] and rec["floor"]["column"] == "nocomm_ms"
    assert [r["tokenweave_over_nccl"] for r in rec["rows"]] == [round(1.6 / 1.5, 3), 0.9]
    assert rec["rows"][1]["tokenweave_over_nocomm"] == 1.125
    (h,) = rec["headline"]
    assert (h["value"], h["baseline"], h["ratio"], h["unit"]) == (4.5, 5.0, 0.9, "ms") and "T=4096" in h["label"]
