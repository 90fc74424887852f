"""No ticket numbers in the tree: file names, flags, environment variables, comments and docs name the concept
("the decode epilogue fusions", "the token-major KV pool"), never the tracker entry or work round that brought it
("issue 27", "round 3", "R7 item 2"). The history lives in git. Scans every tracked file (paths and text) of the
product, the benchmarks, the scripts and the tests.

Exempt: archived benchmark results (``benchmark/**/results/archive/**``: measured files keep the names they were
written under), citations of such an archived file (its path, its base name, or a ``..._``-elided tail of it), and
the few lines in ``ALLOWED`` (each with its reason)."""

from __future__ import annotations

import collections
import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: A ticket reference: "issue 27", "Issue-24", "issue27_report", "issue #9", "ticket 3", "round 2" / "_round3_" (a
#: work round), "R7 item 2", "24 item 6", "item 4 of the issue". Not: "tissue 3", ".../issues/123" (an upstream
#: URL), "issues", "around 3", "rounded to 2", "round(x, 2)".
TICKET = re.compile(
    r"(?<![a-z])(?:issue|ticket)[ _-]?#?\d+"
    r"|(?<![a-z])round[ _-]?\d+(?!\.\d)"
    r"|\bR\d+ items?\b|\b\d+ items? \d+\b"
    r"|\bitems? \d+ (?:of|in) (?:the |a |this )?(?:project )?(?:issue|ticket)",
    re.IGNORECASE)

#: Archived measurements keep their historical file names.
ARCHIVE = re.compile(r"^benchmark/(?:.+/)?results/archive/")

#: (path regex, line regex, reason): the only lines allowed to match ``TICKET``.
ALLOWED = [
    (r"test/unit/test_bench_tokenweave_e2e\.py", r"\(round \d\) vs off \(round \d\)",
     "bench_tokenweave_e2e.py numbers its off/on pairs 'round 1, 2, ...' in the equality table the test reads"),
    (r"benchmark/(?:.+/)?bench_kv_cache_dtype_serving\.py", r"round 0: as listed; round 1: reversed",
     "--repeats alternates the dtype order; the docstring names the benchmark's own repeat rounds"),
    (r"test/unit/test_no_ticket_numbers\.py", r".",
     "this check: its docstrings and matcher cases spell out what a ticket reference looks like"),
]


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        out = None
    if out is None or out.returncode != 0 or not out.stdout:
        pytest.skip("not a git checkout: the check reads the tracked files")
    return [p for p in out.stdout.decode().split("\0") if p]


def _archived_names(paths: list[str]) -> frozenset[str]:
    """Base names of the archived result files (the names a citation may carry)."""
    return frozenset(PurePosixPath(p).name for p in paths if ARCHIVE.match(p))


def _cites_archive(token: str, archived: frozenset[str]) -> bool:
    """``token`` names an archived file: by path or base name, or as a ``..._``-elided tail of its base name."""
    name = token.rstrip(".,;:").rsplit("/", 1)[-1]
    if name in archived:
        return True
    return name.startswith("..._") and any(a.endswith(name[3:]) for a in archived)


def ticket_refs(line: str, archived: frozenset[str] = frozenset()) -> list[str]:
    """The ticket references in ``line``, less those inside a citation of an archived result file."""
    refs = []
    for m in TICKET.finditer(line):
        if archived:
            start, end = m.start(), m.end()
            while start > 0 and re.match(r"[\w./-]", line[start - 1]):
                start -= 1
            while end < len(line) and re.match(r"[\w./-]", line[end]):
                end += 1
            if _cites_archive(line[start:end], archived):
                continue
        refs.append(m.group(0))
    return refs


def _allowed(path: str, line: str) -> bool:
    return any(re.fullmatch(p, path) and re.search(l, line) for p, l, _ in ALLOWED)


def find_hits(paths: list[str]) -> dict[str, list[tuple[int, str]]]:
    """{path: [(line number, text)]} of every ticket reference; line 0 is the file's path itself."""
    archived = _archived_names(paths)
    hits: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for p in paths:
        if ARCHIVE.match(p):
            continue
        if ticket_refs(p):
            hits[p].append((0, "(file name)"))
        f = ROOT / p
        if not f.is_file() or f.is_symlink():
            continue
        data = f.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if ticket_refs(line, archived) and not _allowed(p, line):
                hits[p].append((n, line.strip()))
    return dict(hits)


def _summary(hits: dict[str, list[tuple[int, str]]], per_file: int = 2) -> str:
    """Grouped by top folder, then file: hit count and the first few ``file:line: text``."""
    out = [f"{sum(map(len, hits.values()))} ticket references in {len(hits)} files (name the concept instead):"]
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for p in sorted(hits):
        groups[p.split("/")[0] if "/" in p else "."].append(p)
    for g, files in groups.items():
        out.append(f"[{g}] {len(files)} files, {sum(len(hits[p]) for p in files)} hits")
        for p in files:
            rows = hits[p]
            out.append(f"  {p}: {len(rows)}")
            out.extend(f"    {p}:{n}: {t[:110]}" for n, t in rows[:per_file])
    return "\n".join(out)


@pytest.mark.parametrize("text", [
    "issue 27", "(issue 24 item 6)", "since issue 27:", "the issue-27 epilogue fusions", "Issue 19 (decode step)",
    "test_issue19_decode", "bench_decode_issue19.py", "2026-11-26_issue25_round1_2xh100.md", "ISSUE24_PD_KILL_ONLY=1",
    "issue #9", "issue_26", "ticket 12", "round 7", "Round 3 on 2 x H200", "the round-2 calibration", "_round3_",
    "test_h100_table_holds_the_round2_measurements", "R7 item 2", "| 24 item 6: FFN worker killed",
    "item 4 of a project issue", "issue2x_4gpu.sh",
])
def test_matcher_finds_ticket_references(text):
    """Every spelling of a ticket, work round or ticket item the tree has used is caught."""
    assert ticket_refs(text), text


@pytest.mark.parametrize("text", [
    "tissue 3", "https://github.com/pytorch/pytorch/issues/12345", "gh issues list --limit 5",
    "open issues",
    "around 3 ms", "rounded to 2 digits", "round(x, 2)", "round up to 16 bytes", "item 4 of the list", "3 items",
    "RMSNorm R2", "issued 4 loads", "a known issue: 2 copies", "round 2.5",
])
def test_matcher_ignores_other_words(text):
    """Ordinary words and upstream issue URLs are not ticket references."""
    assert not ticket_refs(text), text


def test_archived_results_may_be_cited_by_name():
    """A citation of an archived result file passes; the same name outside the archive, or prose, does not."""
    paths = ["benchmark/decode/results/archive/2026-11-27_issue27_round4_h100.md", "README.md"]
    archived = _archived_names(paths)
    assert not ticket_refs("see benchmark/decode/results/archive/2026-11-27_issue27_round4_h100.md.", archived)
    assert not ticket_refs("(`2026-11-27_issue27_round4_h100.md`, `..._round4_h100.md`)", archived)
    assert ticket_refs("benchmark/results/2026-11-27_issue27_round9_h100.md (issue 27)", archived) == [
        "issue27", "round9", "issue 27"]
    assert ticket_refs("scripts/gpu/issue27_1gpu.sh", archived) == ["issue27"]


def test_no_ticket_numbers_in_the_tree():
    """No tracked path or line outside the archive and ``ALLOWED`` carries a ticket reference."""
    hits = find_hits(_tracked())
    if hits:
        pytest.fail(_summary(hits), pytrace=False)
