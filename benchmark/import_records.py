"""Land the benchmark records a GPU run brought back into ``benchmark/results/<subject>/``.

A GPU suite (``scripts/gpu/one_gpu.sh`` and its siblings) sets ``BENCHMARK_RECORD_DIR`` for every step, so each
benchmark a step runs writes its JSON record (:mod:`benchmark.common.records`) into the suite's work folder, and the
suite's tarball (``$OUT/<suite>.tgz``) carries them back. This command finds every record in the tarballs, folders or
JSON files it is given, validates all of them first (one bad record: nothing is written, the error names the file),
then writes each as ``<results>/<subject>/<date>_<what>_<gpu>.{json,md}`` (the markdown re-rendered from the JSON).

* A record already landed (an identical JSON in its subject folder) is skipped, so landing the same tarball twice
  writes nothing.
* A record measured without a GPU (``gpu.count`` 0: a CPU smoke or a dry run) is skipped unless ``--allow-cpu``.
* JSON files that are not records (no integer ``schema``: a benchmark's own raw output) are ignored.
* ``--measured-commit SHA`` corrects the provenance of records whose run could not see its own commit (a device
  machine's copy of the working tree can carry an older ``.git``; a record then names that commit, dirty): the
  record's ``git_commit`` becomes SHA, ``git_dirty`` False, and a note keeps what the run itself recorded. Runs that
  start with ``BENCHMARK_GIT_COMMIT=<sha>`` need no correction.
* ``--readme README.md`` then regenerates the README's performance section (:mod:`benchmark.report`).

Usage (from the repository root)::

    python -m benchmark.import_records /work/.device/.../one_gpu.tgz --readme README.md
    python -m benchmark.import_records out_dir/ --dry-run
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmark.common.records import RESULTS_ROOT, record_paths, render_markdown, validate_record  # noqa: E402

__all__ = ["find_in", "with_commit", "plan_import", "import_records", "main"]


def _as_record(text: str) -> Optional[dict]:
    """The JSON object in ``text`` if it claims to be a record (an integer ``schema``), else None."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("schema"), int) else None


def find_in(path: Path) -> list[tuple[str, dict]]:
    """Every record in ``path`` (a ``.tgz`` / ``.tar.gz`` / ``.tar``, a folder searched recursively, or one ``.json``),
    as (where it was found, record), not yet validated. FileNotFoundError when ``path`` does not exist; ValueError for
    a file that is none of these."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    found = []
    if path.is_dir():
        for p in sorted(path.rglob("*.json")):
            rec = _as_record(p.read_text(errors="replace"))
            if rec is not None:
                found.append((str(p), rec))
    elif path.name.endswith((".tgz", ".tar.gz", ".tar")):
        with tarfile.open(path) as tar:
            for m in sorted(tar.getmembers(), key=lambda m: m.name):
                if m.isfile() and m.name.endswith(".json"):
                    f = tar.extractfile(m)
                    rec = None if f is None else _as_record(f.read().decode(errors="replace"))
                    if rec is not None:
                        found.append((f"{path}:{m.name}", rec))
    elif path.suffix == ".json":
        rec = _as_record(path.read_text(errors="replace"))
        if rec is not None:
            found.append((str(path), rec))
    else:
        raise ValueError(f"{path}: give a suite tarball (.tgz), a folder or a .json record")
    return found


def with_commit(rec: dict, commit: str) -> dict:
    """A copy of ``rec`` that names ``commit`` as the code it measured (see ``--measured-commit``); a note keeps the
    commit and dirty flag the run recorded. ValueError for an empty or non-hex ``commit``."""
    if not commit or any(c not in "0123456789abcdef" for c in commit.lower()):
        raise ValueError(f"measured commit {commit!r} is not a git commit id (hex)")
    if rec.get("git_commit") == commit and not rec.get("git_dirty"):
        return rec
    note = (f"provenance corrected when landed: the run recorded git_commit {rec.get('git_commit')} "
            f"(dirty={rec.get('git_dirty')}) from the device copy's git metadata; it measured the working tree of "
            f"commit {commit}")
    return {**rec, "git_commit": commit, "git_dirty": False, "notes": [*rec.get("notes", []), note]}


def _landed(rec: dict, folder: Path) -> Optional[Path]:
    """The JSON in ``folder`` equal to ``rec``, if one is there."""
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            if json.loads(p.read_text()) == rec:
                return p
        except ValueError:
            continue
    return None


def plan_import(found: Iterable[tuple[str, dict]], results_root: Path = RESULTS_ROOT,
                allow_cpu: bool = False) -> tuple[list[tuple[str, dict]], list[str]]:
    """Validate every found record, then split them into (to write, skipped messages). ValueError names the first
    invalid record's origin and field; nothing is written by this function."""
    found = list(found)
    for origin, rec in found:
        try:
            validate_record(rec)
        except ValueError as e:
            raise ValueError(f"{origin}: {e}") from None
    write, skipped, seen = [], [], []
    for origin, rec in found:
        if not allow_cpu and not rec["gpu"].get("count"):
            skipped.append(f"{origin}: measured without a GPU (pass --allow-cpu to land it)")
            continue
        if rec in seen:
            skipped.append(f"{origin}: the same record twice in the inputs")
            continue
        seen.append(rec)
        there = _landed(rec, Path(results_root) / rec["subject"])
        if there is not None:
            skipped.append(f"{origin}: already landed as {there}")
            continue
        write.append((origin, rec))
    return write, skipped


def import_records(paths: Sequence[Path], results_root: Path = RESULTS_ROOT, allow_cpu: bool = False,
                   dry_run: bool = False, measured_commit: Optional[str] = None) -> tuple[list[Path], list[str]]:
    """Find, validate and land the records in ``paths`` (see the module docstring; ``measured_commit``:
    :func:`with_commit` on each); returns (JSON paths written, or that would be with ``dry_run``; skipped
    messages). Raises what :func:`find_in`, :func:`with_commit` and :func:`plan_import` raise, before anything is
    written."""
    found = [x for p in paths for x in find_in(Path(p))]
    if measured_commit:
        found = [(origin, with_commit(rec, measured_commit)) for origin, rec in found]
    write, skipped = plan_import(found, results_root, allow_cpu)
    written = []
    for _, rec in write:
        js, md = record_paths(rec, results_root)
        if not dry_run:
            js.parent.mkdir(parents=True, exist_ok=True)
            js.write_text(json.dumps(rec, indent=1) + "\n")
            md.write_text(render_markdown(rec, json_name=js.name))
        written.append(js)
    return written, skipped


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="suite tarballs (.tgz), folders or .json records")
    ap.add_argument("--results", default=str(RESULTS_ROOT), help="results folder (default: benchmark/results)")
    ap.add_argument("--allow-cpu", action="store_true", help="also land records measured without a GPU")
    ap.add_argument("--dry-run", action="store_true", help="say what would be written; write nothing")
    ap.add_argument("--measured-commit", metavar="SHA", help="the commit the run measured, when its records name "
                    "an older one (a device copy's stale .git): see the module docstring")
    ap.add_argument("--readme", help="then regenerate the performance section of this markdown file")
    args = ap.parse_args(argv)
    try:
        written, skipped = import_records([Path(p) for p in args.paths], Path(args.results), args.allow_cpu,
                                          args.dry_run, args.measured_commit)
    except (OSError, ValueError, tarfile.TarError) as e:
        print(f"import_records: {e}; nothing was written", file=sys.stderr)
        return 1
    for s in skipped:
        print(f"skipped {s}")
    for js in written:
        print(f"{'would write' if args.dry_run else 'wrote'} {js} (+ .md)")
    print(f"{len(written)} record(s) {'to land' if args.dry_run else 'landed'}, {len(skipped)} skipped")
    if args.readme and not args.dry_run:
        from benchmark.report import main as report_main
        return report_main(["--readme", args.readme, "--results", args.results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
