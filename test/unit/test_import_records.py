"""``python -m benchmark.import_records``: records a GPU suite brought back (in its tarball) land under
``results/<subject>/`` with their markdown, validated before anything is written, once; CPU records and raw JSON stay
out; and every benchmark's ``--record-dir`` defaults to ``$BENCHMARK_RECORD_DIR`` (what the suites set)."""

from __future__ import annotations

import argparse
import os
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from conftest import REPO_ROOT as _ROOT
from benchmark import import_records as imp
from benchmark.common import records

REPO_ROOT = Path(_ROOT)


def _rec(date="2026-12-07T10:00:00+00:00", value=1.25, count=1, what="floor_ratio", subject="decode"):
    env = {"git_commit": "c0ffee", "git_dirty": False, "date": date,
           "gpu": {"model": "NVIDIA H100 80GB HBM3" if count else "cpu", "count": count},
           "versions": {"python": "3.12"}, "platform": "Linux"}
    return records.make_record(subject=subject, benchmark="benchmark.decode.bench", mode="floor", what=what,
                               rows=[{"batch": 1, "ms": value, "floor_ms": value / 2}], baselines=["floor_ms"],
                               command="python -m benchmark.decode.bench", env=env,
                               headline=[{"label": "decode batch 1 / floor", "value": 2.0, "unit": "x"}])


@pytest.fixture
def suite_tgz(tmp_path):
    """A suite tarball as lib_suite.sh packs it: records under one_gpu_work/records/<subject>/, plus a raw JSON a
    benchmark wrote for itself and a record from a CPU smoke."""
    work = tmp_path / "one_gpu_work"
    gpu_rec, comm_rec, cpu_rec = _rec(), _rec(what="allreduce", subject="comm"), _rec(count=0, what="smoke")
    for r in (gpu_rec, comm_rec, cpu_rec):
        records.write_record(r, work / "records")
    (work / "decode_floor").mkdir(parents=True)
    (work / "decode_floor" / "raw.json").write_text(json.dumps({"rows": [1, 2]}))
    tgz = tmp_path / "one_gpu.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(work, arcname=work.name)
    return tgz, gpu_rec, comm_rec


def test_tarball_records_land_once_with_markdown(suite_tgz, tmp_path):
    tgz, gpu_rec, comm_rec = suite_tgz
    results = tmp_path / "results"
    written, skipped = imp.import_records([tgz], results)
    assert sorted(p.relative_to(results).as_posix() for p in written) == [
        "comm/2026-12-07_allreduce_h100.json", "decode/2026-12-07_floor_ratio_h100.json"]
    assert records.load_record(results / "decode" / "2026-12-07_floor_ratio_h100.json") == gpu_rec
    md = (results / "decode" / "2026-12-07_floor_ratio_h100.md").read_text()
    assert md == records.render_markdown(gpu_rec, json_name="2026-12-07_floor_ratio_h100.json")
    assert len(skipped) == 1 and "without a GPU" in skipped[0] and "smoke" in skipped[0]
    again, skipped2 = imp.import_records([tgz], results)  # landing the same tarball twice writes nothing
    assert again == [] and sum("already landed" in s for s in skipped2) == 2


def test_cpu_records_land_only_when_asked(suite_tgz, tmp_path):
    tgz, _, _ = suite_tgz
    written, _ = imp.import_records([tgz], tmp_path / "r", allow_cpu=True)
    assert any(p.name == "2026-12-07_smoke_cpu.json" for p in written)


def test_a_bad_record_writes_nothing_and_is_named(tmp_path):
    good = tmp_path / "in" / "good.json"
    good.parent.mkdir()
    good.write_text(json.dumps(_rec()))
    bad = dict(_rec(what="other"))
    bad["subject"] = "nonsense"
    (tmp_path / "in" / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"bad\.json.*nonsense"):
        imp.import_records([tmp_path / "in"], tmp_path / "results")
    assert not (tmp_path / "results").exists()


def test_a_newer_run_of_the_same_benchmark_lands_beside_the_older(tmp_path):
    results = tmp_path / "results"
    imp.import_records([_write_json(tmp_path / "a.json", _rec(value=1.25))], results)
    written, _ = imp.import_records([_write_json(tmp_path / "b.json", _rec(value=1.5))], results)
    assert [p.name for p in written] == ["2026-12-07_floor_ratio_h100-2.json"]


def _write_json(path, rec):
    path.write_text(json.dumps(rec))
    return path


def test_cli_dry_run_and_missing_input(tmp_path, suite_tgz):
    tgz, _, _ = suite_tgz
    py = ["python3", "-m", "benchmark.import_records"]
    out = subprocess.run(py + [str(tgz), "--results", str(tmp_path / "r"), "--dry-run"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "2 record(s) to land" in out.stdout and not (tmp_path / "r").exists()
    out = subprocess.run(py + [str(tmp_path / "nope.tgz")], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "nope.tgz" in out.stderr and "nothing was written" in out.stderr


def test_record_dir_defaults_to_the_environment(monkeypatch):
    monkeypatch.delenv(records.RECORD_DIR_ENV, raising=False)
    p = argparse.ArgumentParser()
    records.add_record_dir_argument(p, "decode")
    assert p.parse_args([]).record_dir is None
    monkeypatch.setenv(records.RECORD_DIR_ENV, "/tmp/suite/records")
    p = argparse.ArgumentParser()
    records.add_record_dir_argument(p, "decode")
    assert p.parse_args([]).record_dir == "/tmp/suite/records"
    assert p.parse_args(["--record-dir", "/x"]).record_dir == "/x"  # an explicit flag wins
    with pytest.raises(ValueError, match="subject 'kernels'"):
        records.add_record_dir_argument(argparse.ArgumentParser(), "kernels")


def test_every_benchmark_with_a_record_dir_uses_the_shared_argument():
    """A benchmark that declares its own ``--record-dir`` would not follow ``$BENCHMARK_RECORD_DIR``, and a suite
    step running it would bring no record back."""
    own = [p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "benchmark").rglob("*.py")
           if 'add_argument("--record-dir"' in p.read_text() and p.name != "records.py"]
    assert own == [], f"use benchmark.common.records.add_record_dir_argument in {own}"


def test_suites_export_the_record_dir():
    text = (REPO_ROOT / "scripts" / "gpu" / "lib_suite.sh").read_text()
    assert 'export BENCHMARK_RECORD_DIR="$work/records"' in text


_RUN_AS_FILES = r"""
import contextlib, io, runpy, sys
base = [p for p in sys.path if p not in ("", ".", ROOT)]
bad = []
for f in FILES:
    sys.path[:] = [f.rsplit("/", 1)[0]] + base  # what `python benchmark/<subject>/<file>.py` starts with
    for m in [m for m in sys.modules if m == "benchmark" or m.startswith("benchmark.")]:
        del sys.modules[m]
    sys.argv = [f, "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(f, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            bad.append(f"{f}: exit {e.code}")
    except Exception as e:
        bad.append(f"{f}: {type(e).__name__}: {e}")
print("\n".join(bad))
"""


def test_benchmarks_with_records_run_as_files():
    """The GPU suites run ``python benchmark/<subject>/<file>.py`` with only ``python/`` on PYTHONPATH: each
    benchmark that takes ``--record-dir`` must find the ``benchmark`` package itself (``--help`` parses its flags)."""
    files = sorted(str(p) for p in (REPO_ROOT / "benchmark").rglob("*.py")
                   if "add_record_dir_argument(" in p.read_text() and p.name != "records.py")
    assert len(files) >= 19
    code = f"ROOT = {str(REPO_ROOT)!r}\nFILES = {files!r}\n" + _RUN_AS_FILES
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = f"{REPO_ROOT / 'python'}:{REPO_ROOT / 'sgl-kernel' / 'python'}"
    out = subprocess.run(["python3", "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", out.stdout


def test_measured_commit_corrects_provenance_and_keeps_what_the_run_said(tmp_path):
    rec = dict(_rec(), git_commit="d853fe3", git_dirty=True)
    written, _ = imp.import_records([_write_json(tmp_path / "a.json", rec)], tmp_path / "r",
                                    measured_commit="611b70c")
    landed = records.load_record(written[0])
    assert landed["git_commit"] == "611b70c" and landed["git_dirty"] is False
    assert "d853fe3" in landed["notes"][-1] and "611b70c" in landed["notes"][-1]
    with pytest.raises(ValueError, match="not a git commit"):
        imp.with_commit(rec, "main; rm")


def test_git_commit_from_the_environment(monkeypatch):
    monkeypatch.setenv(records.GIT_COMMIT_ENV, "abc1234")
    env = records.environment()
    assert env["git_commit"] == "abc1234" and env["git_dirty"] is False
