"""The one result format of every benchmark: a JSON record plus the markdown rendered from it, written as
``benchmark/results/<subject>/<date>_<what>_<gpu>.{json,md}``.

A record (schema version :data:`SCHEMA_VERSION`) is a dict with

* ``schema``, ``subject`` (one of :data:`SUBJECTS`), ``benchmark`` (the entry point, e.g. ``benchmark.decode.bench``),
  ``mode`` (the entry point's mode), ``what`` (the file-name slug, ``[a-z0-9_-]+``);
* ``git_commit`` and ``git_dirty``, ``date`` (UTC, ISO 8601), ``gpu`` (``model``, ``count``, ``driver``),
  ``versions`` (``python``, ``torch``, ``cuda``, ``nccl``, ``triton``), ``command`` (the exact command line);
* ``rows``: a list of flat dicts, one per measured case, holding the measured columns, the same-run baselines'
  columns and the ratios (:func:`add_ratio`); ``baselines`` names the baseline columns, ``units`` the unit of any
  column, ``floor`` describes a physical-floor column when there is one;
* optional ``params`` (the configuration), ``headline`` (the few numbers :mod:`benchmark.report` shows per technique:
  ``label``, ``value``, ``unit``, ``baseline``, ``ratio``), ``notes`` (sentences) and ``source`` (for a record
  transcribed from an older markdown result: the archived file it came from).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

from benchmark.common.timing import ratio

__all__ = ["SCHEMA_VERSION", "SUBJECTS", "RESULTS_ROOT", "REPO_ROOT", "RECORD_DIR_ENV", "GIT_COMMIT_ENV",
           "add_record_dir_argument", "environment", "gpu_slug", "make_record", "add_ratio", "record_stem", "record_paths", "write_record", "load_record", "validate_record",
           "render_markdown", "format_value", "command_line"]

SCHEMA_VERSION = 1
SUBJECTS = ("comm", "tokenweave", "tdist", "disaggregation", "afd", "decode", "serving", "moe", "quantization",
            "attention")
REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_ROOT = REPO_ROOT / "benchmark" / "results"
REQUIRED = ("schema", "subject", "benchmark", "mode", "what", "git_commit", "date", "gpu", "versions", "command",
            "rows")
#: The environment variable that gives ``--record-dir`` its default (the GPU suites set it for every step, so every
#: benchmark a step runs writes its record into the suite's tarball; an explicit ``--record-dir`` wins).
RECORD_DIR_ENV = "BENCHMARK_RECORD_DIR"
_SLUG = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_GPU_NAME = re.compile(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b")


def _run(argv: Sequence[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        out = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


#: The commit a run measures, when the checkout's own git metadata cannot say it: a device machine runs on a copy of
#: the working tree whose ``.git`` may be older than the files (``BENCHMARK_GIT_COMMIT=$(git rev-parse HEAD)`` at
#: the start of the device command, evaluated where the commit was made). Set, it is the record's ``git_commit`` and
#: ``git_dirty`` is False.
GIT_COMMIT_ENV = "BENCHMARK_GIT_COMMIT"


def _git(repo: Path) -> tuple[str, Optional[bool]]:
    given = os.environ.get(GIT_COMMIT_ENV, "").strip()
    if given:
        return given, False
    commit = _run(["git", "rev-parse", "HEAD"], repo) or "unknown"
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], repo)
    return commit, (None if status is None else bool(status))


def _gpus() -> dict:
    """GPU model, count and driver: ``nvidia-smi`` first (it does not initialise CUDA in this process), restricted
    to ``CUDA_VISIBLE_DEVICES`` when set; torch as a fallback; ``{"model": "cpu", "count": 0}`` without a GPU."""
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        lines = [tuple(x.strip() for x in ln.split(",", 1)) for ln in smi.splitlines() if ln.strip()]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.strip():
            idx = [int(i) for i in visible.split(",") if i.strip().isdigit()]
            lines = [lines[i] for i in idx if i < len(lines)] or lines
        if lines:
            return {"model": lines[0][0], "count": len(lines), "driver": lines[0][1] if len(lines[0]) > 1 else None}
    try:
        import torch

        if torch.cuda.is_available():
            return {"model": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(), "driver": None}
    except Exception:  # a broken CUDA install still gets a CPU record
        pass
    return {"model": "cpu", "count": 0, "driver": None}


def _versions() -> dict:
    v = {"python": platform.python_version(), "torch": None, "cuda": None, "nccl": None, "triton": None}
    try:
        import torch

        v["torch"] = torch.__version__
        v["cuda"] = torch.version.cuda
        try:
            nccl = torch.cuda.nccl.version()
            v["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception:  # CPU-only torch builds have no NCCL
            pass
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        v["triton"] = version("triton")
    except Exception:
        pass
    return v


def add_record_dir_argument(parser, subject: str, scope: str = "") -> None:
    """Add the ``--record-dir DIR`` option every benchmark shares to an argparse ``parser``: write the run's record
    under ``DIR/<subject>/`` (:func:`write_record`). Its default is the environment variable :data:`RECORD_DIR_ENV`
    (unset: no record). ``scope`` prefixes the help text (e.g. ``"decode mode: "``). ValueError for an unknown
    ``subject``."""
    if subject not in SUBJECTS:
        raise ValueError(f"subject {subject!r} is not one of {SUBJECTS}")
    parser.add_argument("--record-dir", default=os.environ.get(RECORD_DIR_ENV) or None, metavar="DIR",
                        help=f"{scope}also write a JSON benchmark record (benchmark.common.records) under "
                             f"DIR/{subject}/ (default: ${RECORD_DIR_ENV}, unset: none)")


def environment(repo: Path = REPO_ROOT) -> dict:
    """The run's provenance: ``git_commit``, ``git_dirty``, ``date`` (UTC now), ``gpu``, ``versions``, ``platform``."""
    commit, dirty = _git(repo)
    return {"git_commit": commit, "git_dirty": dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
            "gpu": _gpus(), "versions": _versions(), "platform": platform.platform()}


def gpu_slug(model: str, count: int = 1) -> str:
    """The file-name form of a GPU: ``"NVIDIA H100 80GB HBM3"`` -> ``h100``, with ``count > 1`` -> ``4xh200``;
    ``"cpu"`` (or no GPU) -> ``cpu``; an unrecognised name is lower-cased to ``[a-z0-9-]``."""
    if not model or model.lower() == "cpu" or count == 0:
        return "cpu"
    m = _GPU_NAME.search(model.upper().replace("NVIDIA", " "))
    slug = m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"{count}x{slug}" if count > 1 else slug


def command_line(argv: Optional[Sequence[str]] = None, module: Optional[str] = None) -> str:
    """The command that reproduces this run: ``python -m <module> <args>`` when ``module`` is given, else
    ``python <script relative to the repo> <args>`` (``argv`` defaults to ``sys.argv``)."""
    argv = list(sys.argv if argv is None else argv)
    if module:
        return shlex.join(["python", "-m", module, *argv[1:]])
    script = argv[0] if argv else ""
    try:
        script = os.path.relpath(script, REPO_ROOT) if script else script
    except ValueError:
        pass
    return shlex.join(["python", script, *argv[1:]])


def add_ratio(rows: Iterable[dict], name: str, num: str, den: str, digits: int = 3) -> list[dict]:
    """Copies of ``rows`` with ``name = row[num] / row[den]`` rounded to ``digits`` (None where either is missing
    or the denominator is 0). E.g. ``add_ratio(rows, "tw_vs_nccl", "nccl_us", "tw_us")`` is the speed-up."""
    out = []
    for row in rows:
        r = ratio(row.get(num), row.get(den))
        out.append({**row, name: None if r is None else round(r, digits)})
    return out


def make_record(*, subject: str, benchmark: str, mode: str, what: str, rows: Sequence[dict],
                command: Optional[str] = None, params: Optional[dict] = None, baselines: Sequence[str] = (),
                units: Optional[dict] = None, floor: Optional[dict] = None, headline: Sequence[dict] = (),
                notes: Sequence[str] = (), env: Optional[dict] = None, gpu_count: Optional[int] = None,
                source: Optional[str] = None) -> dict:
    """A validated record (see the module docstring). ``env`` defaults to :func:`environment` (pass one to reuse a
    probe or for tests); ``gpu_count`` overrides the probed count when a run uses fewer GPUs than the host has;
    ``command`` defaults to :func:`command_line`. Raises ValueError naming the bad field."""
    env = dict(env or environment())
    gpu = dict(env["gpu"])
    if gpu_count is not None:
        gpu["count"] = gpu_count
    rec = {"schema": SCHEMA_VERSION, "subject": subject, "benchmark": benchmark, "mode": mode, "what": what,
           "git_commit": env["git_commit"], "git_dirty": env.get("git_dirty"), "date": env["date"], "gpu": gpu,
           "versions": env["versions"], "platform": env.get("platform"),
           "command": command or command_line(), "params": dict(params or {}), "baselines": list(baselines),
           "units": dict(units or {}), "floor": floor, "rows": [dict(r) for r in rows],
           "headline": [dict(h) for h in headline], "notes": list(notes)}
    if source:
        rec["source"] = source
    validate_record(rec)
    return rec


def validate_record(rec: dict) -> dict:
    """Check a record's fields; returns it. ValueError names the first missing or malformed field."""
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise ValueError(f"benchmark record lacks {missing}; build it with benchmark.common.records.make_record")
    if rec["schema"] != SCHEMA_VERSION:
        raise ValueError(f"record schema {rec['schema']!r} is not {SCHEMA_VERSION}")
    if rec["subject"] not in SUBJECTS:
        raise ValueError(f"subject {rec['subject']!r} is not one of {SUBJECTS}")
    if not isinstance(rec["what"], str) or not _SLUG.match(rec["what"]):
        raise ValueError(f"what={rec['what']!r}: use lower-case [a-z0-9_-] (it becomes part of the file name)")
    for key in ("benchmark", "mode", "command", "git_commit", "date"):
        if not isinstance(rec[key], str) or not rec[key]:
            raise ValueError(f"record field {key!r} must be a non-empty string, got {rec[key]!r}")
    if not isinstance(rec["gpu"], dict) or not {"model", "count"} <= set(rec["gpu"]):
        raise ValueError(f"record field 'gpu' needs 'model' and 'count', got {rec['gpu']!r}")
    if not isinstance(rec["rows"], list) or not all(isinstance(r, dict) for r in rec["rows"]):
        raise ValueError("record field 'rows' must be a list of dicts (one per measured case)")
    columns = {k for r in rec["rows"] for k in r}
    unknown = [b for b in rec.get("baselines", []) if b not in columns]
    if unknown:
        raise ValueError(f"baselines {unknown} name no column of the rows (columns: {sorted(columns)})")
    for h in rec.get("headline", []):
        if "label" not in h or "value" not in h:
            raise ValueError(f"headline entry {h!r} needs 'label' and 'value'")
    try:
        json.dumps(rec)
    except TypeError as e:
        raise ValueError(f"record is not JSON-serialisable: {e}") from None
    return rec


def record_stem(rec: dict) -> str:
    """``<date>_<what>_<gpu>``: e.g. ``2026-11-27_allreduce_rmsnorm_4xh200``."""
    return f"{rec['date'][:10]}_{rec['what']}_{gpu_slug(rec['gpu']['model'], rec['gpu']['count'])}"


def record_paths(rec: dict, results_root: Path = RESULTS_ROOT) -> tuple[Path, Path]:
    """Where :func:`write_record` puts a record: ``<results_root>/<subject>/<stem>{,-2,-3,...}.{json,md}``, the first
    suffix whose JSON does not exist yet (a second run the same day keeps the first)."""
    folder = Path(results_root) / rec["subject"]
    stem = record_stem(rec)
    n = 1
    while (folder / f"{stem}{'' if n == 1 else f'-{n}'}.json").exists():
        n += 1
    base = folder / f"{stem}{'' if n == 1 else f'-{n}'}"
    return base.with_suffix(".json"), base.with_suffix(".md")


def write_record(rec: dict, results_root: Path = RESULTS_ROOT) -> tuple[Path, Path]:
    """Validate and write the record's JSON and its markdown; returns both paths."""
    validate_record(rec)
    js, md = record_paths(rec, results_root)
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps(rec, indent=1) + "\n")
    md.write_text(render_markdown(rec, json_name=js.name))
    return js, md


def load_record(path) -> dict:
    """Read and validate one JSON record."""
    return validate_record(json.loads(Path(path).read_text()))


def format_value(v) -> str:
    """A cell: None -> ``-``, bools as yes/no, floats with 4 significant digits (no exponent below 1e6)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v == 0 or 1e-3 <= abs(v) < 1e6:
            digits = max(0, 3 - int(f"{abs(v):e}".split("e")[1])) if v else 0
            return f"{v:.{min(digits, 6)}f}"
        return f"{v:.3e}"
    if isinstance(v, (list, tuple)):
        return ", ".join(format_value(x) for x in v)
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True)
    return str(v).replace("|", "\\|").replace("\n", " ")


def _columns(rows: Sequence[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols)
    return cols


def render_markdown(rec: dict, json_name: Optional[str] = None) -> str:
    """The record as markdown: provenance, parameters, the rows table (baseline columns marked, units in the
    header), the floor and the notes. Everything in it comes from the record."""
    gpu = rec["gpu"]
    v = rec["versions"]
    gpu_text = "CPU (no GPU)" if gpu.get("count", 0) == 0 else f"{gpu['count']} x {gpu['model']}"
    lines = [f"# {rec['benchmark']} --mode {rec['mode']}: {rec['what']} on {gpu_slug(gpu['model'], gpu['count'])}",
             "", f"- date: {rec['date']}",
             f"- commit: `{rec['git_commit']}`" + (" (uncommitted changes)" if rec.get("git_dirty") else ""),
             f"- GPU: {gpu_text}" + (f", driver {gpu['driver']}" if gpu.get("driver") else ""),
             "- versions: " + ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "cuda", "nccl", "triton")
                                         if v.get(k)),
             f"- command: `{rec['command']}`"]
    if rec.get("source"):
        lines.append(f"- source: transcribed from `{rec['source']}`")
    if json_name:
        lines.append(f"- record: [{json_name}]({json_name})")
    if rec.get("params"):
        lines += ["", "Parameters: " + ", ".join(f"{k}={format_value(val)}" for k, val in rec["params"].items())]
    rows = rec["rows"]
    if rows:
        cols = _columns(rows)
        units = rec.get("units") or {}
        base = set(rec.get("baselines") or [])
        head = [f"{c}{f' ({units[c]})' if c in units else ''}{' [baseline]' if c in base else ''}" for c in cols]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(format_value(r.get(c)) for c in cols) + " |" for r in rows]
    if rec.get("baselines"):
        lines += ["", "Same-run baselines: " + ", ".join(f"`{b}`" for b in rec["baselines"]) + "."]
    if rec.get("floor"):
        floor = rec["floor"]
        lines += ["", "Physical floor: " + (floor if isinstance(floor, str) else format_value(floor))]
    if rec.get("headline"):
        lines += ["", "Headline:"]
        for h in rec["headline"]:
            extra = "".join(f", {k} {format_value(h[k])}" for k in ("baseline", "ratio") if h.get(k) is not None)
            lines.append(f"- {h['label']}: {format_value(h['value'])}{' ' + h['unit'] if h.get('unit') else ''}{extra}")
    if rec.get("notes"):
        lines += [""] + [f"- {n}" for n in rec["notes"]]
    return "\n".join(lines) + "\n"
