"""``python -m benchmark.report``: the newest record per (benchmark, mode, what, GPU) wins, tables link each number
to its record, and ``--readme``/``--check`` regenerate or verify a README section between its markers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from benchmark import report
from benchmark.common import records


def _env(date, gpu="NVIDIA H100 80GB HBM3", count=1):
    return {"git_commit": "c0ffee", "git_dirty": False, "date": date, "gpu": {"model": gpu, "count": count},
            "versions": {"python": "3.12"}, "platform": "Linux"}


def _write(root, date, value, gpu="NVIDIA H100 80GB HBM3", count=1, what="floor_ratio", subject="decode"):
    rec = records.make_record(subject=subject, benchmark="benchmark.decode.bench", mode="floor", what=what,
                              rows=[{"batch": 1, "ms": value}], command="python -m benchmark.decode.bench",
                              env=_env(date, gpu, count),
                              headline=[{"label": "decode batch 1 / floor", "value": value, "unit": "x"}])
    return records.write_record(rec, root)


@pytest.fixture
def results(tmp_path):
    tmp_path = tmp_path / "results"
    old = _write(tmp_path, "2026-11-20T00:00:00+00:00", 1.5)
    new = _write(tmp_path, "2026-11-27T00:00:00+00:00", 1.219)
    h200 = _write(tmp_path, "2026-11-21T00:00:00+00:00", 1.33, gpu="NVIDIA H200")
    other = _write(tmp_path, "2026-11-01T00:00:00+00:00", 42.0, count=4, what="allreduce", subject="comm")
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "old.json").write_text("{}")  # not under a subject folder: never read
    return tmp_path, old, new, h200, other


def test_newest_record_per_gpu_wins(results):
    root, old, new, h200, other = results
    cur = report.current_records(report.find_records(root))
    assert list(cur) == ["comm", "decode"]
    assert [p for p, _ in cur["decode"]] == [new[0], h200[0]]
    text = report.render_current(cur, root)
    assert "[1.219 x](decode/2026-11-27_floor_ratio_h100.md)" in text and "1.500" not in text
    assert "| h200 |" in text and "| 4xh100 |" in text and text.index("### comm") < text.index("### decode")


def test_archived_subject_folder_is_read_like_the_current_one(results):
    """A record under ``archive/<subject>/`` (kept under its old labels) competes with the current folder's: the
    newest per GPU wins wherever it sits."""
    root, old, new, h200, other = results
    archived = _write(root / "archive", "2026-11-28T00:00:00+00:00", 1.2, gpu="NVIDIA H200")
    cur = report.current_records(report.find_records(root))
    assert [p for p, _ in cur["decode"]] == [new[0], archived[0]]


def test_invalid_record_is_named(tmp_path):
    (tmp_path / "decode").mkdir()
    (tmp_path / "decode" / "bad.json").write_text('{"schema": 1}')
    with pytest.raises(ValueError, match="bad.json"):
        report.find_records(tmp_path)


def test_readme_section_regenerates_and_checks(results, tmp_path):
    root = results[0]
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Performance\n\n{report.BEGIN}\nstale\n{report.END}\n\nafter\n")
    args = ["--results", str(root), "--readme", str(readme)]
    assert report.main(args + ["--check"]) == 1
    assert report.main(args) == 0
    text = readme.read_text()
    assert "\nstale\n" not in text and "after" in text and "(results/decode/2026-11-27_floor_ratio_h100.md)" in text
    assert report.main(args + ["--check"]) == 0
    with pytest.raises(ValueError, match="marker"):
        report.replace_section("no markers", "body")


def test_module_entry_point_runs_from_the_repo_root(results):
    out = subprocess.run([sys.executable, "-m", "benchmark.report", "--results", str(results[0]), "--subject",
                          "comm"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "### comm" in out.stdout and "### decode" not in out.stdout


def test_readme_section_lists_markdown_only_results_and_skips_free_form_json(results, capsys):
    root = results[0]
    (root / "decode" / "2026-11-28_step_h100.md").write_text("# a markdown-only result\n")
    (root / "decode" / "2026-11-28_profile_h100.json").write_text('{"rows": [1, 2]}')  # older free-form JSON
    (root / "decode" / "2026-11-28_cost_h100.json").write_text('{"schema": "other-format/1"}')  # another schema
    (root / "index.md").write_text("| [2026-11-28_step_h100.md](decode/2026-11-28_step_h100.md) | "
                                   "decode step, second run | `old_name.md` |\n")
    assert report.main(["--results", str(root), "--readme-section"]) == 0
    out = capsys.readouterr().out
    assert "1.219 x](" in out and "2026-11-27_floor_ratio_h100.md" in out  # the record's table comes first
    assert "- [2026-11-28_step_h100.md](" in out and ": decode step, second run" in out
    assert "2026-11-28_profile_h100.json" in out and "2026-11-28_cost_h100.json" in out
    assert report.main(["--results", str(root), "--readme-section", "--limit", "1"]) == 0
    listed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("- [2026-11-28")]
    assert listed == [ln for ln in listed[:1]]  # one markdown-only entry per subject
