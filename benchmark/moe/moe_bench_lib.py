"""Pieces of the MoE expert-parallel benchmark (``bench_moe_overlap.py``): model configs cut to a few layers with
dummy weights, the batches (decode for small token counts, prefill for large ones), the MoE-layer view of a model,
the no-communication counterfactual, alternating-order timing with CUDA-event medians, and the JSON / markdown
record.

Nothing here is imported by the server; it imports the engine (``sglang``) and torch.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
MODEL_CONFIGS = {"qwen3-30b-a3b": SHARED / "configs" / "Qwen--Qwen3-30B-A3B",
                 "mixtral-8x7b": SHARED / "configs" / "mistralai--Mixtral-8x7B-v0.1",
                 "tiny-moe": SHARED / "models" / "stories260K-moe8"}  # the smoke mode's model (CPU, seconds)
DECODE_MAX = 256  # token counts up to this run as decode batches (one token per request), larger as prefills
PREFILL_REQ = 512  # prefill batches: requests of this many new tokens (fewer when the batch is smaller)
DECODE_CONTEXT = 32  # decode batches: tokens of KV each request already has


def shrunk_config(name: str, layers: int) -> str:
    """A temporary model folder whose ``config.json`` is model ``name``'s (:data:`MODEL_CONFIGS`) with ``layers``
    decoder layers (weights: ``--load-format dummy``). Raises ValueError for an unknown name, FileNotFoundError when
    the shared configs are absent."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODEL_CONFIGS)}")
    cfg = json.loads((MODEL_CONFIGS[name] / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    cfg.pop("mlp_only_layers", None)
    d = tempfile.mkdtemp(prefix=f"moe-bench-{name}-")
    (Path(d) / "config.json").write_text(json.dumps(cfg))
    return d


def batch_shape(tokens: int) -> tuple[str, list[int]]:
    """``("decode", [1] * tokens)`` up to :data:`DECODE_MAX` tokens, else ``("prefill", new tokens per request)``
    in requests of :data:`PREFILL_REQ` (the last one shorter)."""
    if tokens <= DECODE_MAX:
        return "decode", [1] * tokens
    full, rest = divmod(tokens, PREFILL_REQ)
    return "prefill", [PREFILL_REQ] * full + ([rest] if rest else [])


def make_batch(model: Any, config: Any, tokens: int, device: torch.device):
    """A :class:`~sglang.test.model_harness.ModelHarness` over ``model`` and the ForwardBatch of ``tokens`` new
    tokens (:func:`batch_shape`; decode requests first get their context, untimed). Triton attention on CUDA."""
    from sglang.test.model_harness import ModelHarness

    mode, lens = batch_shape(tokens)
    ctx = DECODE_CONTEXT if mode == "decode" else 0
    backend = "triton" if device.type == "cuda" else "torch_native"
    h = ModelHarness(model, harness_shim(config, model), max_reqs=len(lens) + 1, max_len=ctx + max(lens) + 2,
                     device=str(device), attention_backend=backend)
    gen = torch.Generator().manual_seed(tokens)
    vocab = int(config.vocab_size)
    if ctx:
        with torch.inference_mode():
            h.step([(i, torch.randint(3, vocab, (ctx,), generator=gen).tolist()) for i in range(len(lens))],
                   poison=False)
    fb = h.prepare([(i, torch.randint(3, vocab, (n,), generator=gen).tolist()) for i, n in enumerate(lens)])
    return h, fb, mode


def harness_shim(config: Any, model: Any):
    """The harness's view of ``config`` with this rank's KV heads (TP shards them)."""
    from types import SimpleNamespace

    from sglang.srt.distributed.parallel_state import local_kv_heads

    return SimpleNamespace(num_hidden_layers=config.num_hidden_layers, head_dim=config.head_dim, dtype=config.dtype,
                           num_key_value_heads=local_kv_heads(config.num_key_value_heads, getattr(model, "tp_size", 1)))


class MoeOnlyLayer(torch.nn.Module):
    """The MoE half of a decoder layer as a staged layer: ``post_attention_norm`` (the norm + all-reduce before the
    MoE block) and the four MoE stages; the layer-level benchmark's unit of work. A state without a residual gets a
    zero one, so the norm always communicates as in a real layer."""

    def __init__(self, layer: Any):
        super().__init__()
        self.inner = layer
        self.mlp = layer.mlp
        self.names = ("post_attention_norm",) + tuple(s for s in layer.stage_names() if s.startswith("moe_"))

    def stage_names(self) -> tuple:
        """``post_attention_norm`` + the MoE stages."""
        return self.names

    def norm_module(self, stage: str):
        """The wrapped layer's norm (see :meth:`LlamaDecoderLayer.norm_module`)."""
        return self.inner.norm_module(stage)

    def run_stage(self, stage: str, st: Any) -> None:
        """One stage on ``st`` (a LayerState)."""
        if st.residual is None:
            st.residual = torch.zeros_like(st.hidden)
        self.inner.run_stage(stage, st)


class MoeLayerModel(torch.nn.Module):
    """The staged-model contract over the MoE half of ``model``'s decoder layers (no embedding, attention or
    logits): the input ``[T, H]`` is a fixed random activation; ``compute_logits`` returns the hidden states. For
    the layer-level rows of the benchmark."""

    def __init__(self, model: Any, max_tokens: int, device: torch.device):
        super().__init__()
        self.layers = torch.nn.ModuleList(MoeOnlyLayer(layer) for layer in model.decoder_layers)
        h = model.config.hidden_size
        gen = torch.Generator().manual_seed(5)
        self.x = (torch.randn(max_tokens, h, generator=gen) * 0.5).to(model.config.dtype).to(device)

    @property
    def decoder_layers(self):
        """The MoE-only layers."""
        return self.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The fixed activation's first ``T`` rows ``[T, H]``."""
        return self.x[: input_ids.shape[0]]

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Identity (no final norm at the layer level)."""
        return hidden

    def compute_logits(self, hidden: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        """The hidden states (no LM head at the layer level)."""
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        """The unsplit forward: every stage of every layer in order."""
        from sglang.srt.layers.stages import LayerState

        st = LayerState(self.embed(input_ids), None, positions, forward_batch)
        for layer in self.layers:
            for s in layer.stage_names():
                layer.run_stage(s, st)
        return st.hidden


def swap_comms(model: Any, comm: Any) -> list:
    """Set every module attribute ``comm`` that holds a communicator to ``comm`` (the no-communication
    counterfactual); returns ``[(module, old)]`` for :func:`restore_comms`."""
    saved = []
    for m in model.modules():
        old = getattr(m, "comm", None)
        if old is not None and hasattr(old, "all_reduce"):
            saved.append((m, old))
            m.comm = comm
    return saved


def restore_comms(saved: list) -> None:
    """Undo :func:`swap_comms`."""
    for m, old in saved:
        m.comm = old


def timed(fn: Callable[[], Any], device: torch.device, barrier: Optional[Callable[[], None]] = None) -> float:
    """Milliseconds of one call of ``fn``: CUDA events on the current stream (device time, launch gaps included)
    on CUDA, ``perf_counter`` elsewhere. ``barrier`` (ranks aligned) runs before the start."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if barrier is not None:
            barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    if barrier is not None:
        barrier()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def median(xs: Sequence[float]) -> float:
    """Median (ValueError when empty)."""
    if not xs:
        raise ValueError("median of no samples")
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def compare_arms(arms: dict, device: torch.device, warmup: int, rounds: int,
                 barrier: Optional[Callable[[], None]] = None) -> dict:
    """Median ms per arm (``name -> (fn, before, after)``; ``before`` / ``after`` are optional and run outside the
    timed window, e.g. to swap communicators): every arm warmed up ``warmup`` times, then ``rounds`` rounds, each
    timing every arm once, in forward order on even rounds and reversed on odd ones (A B, B A, ...), so drift
    favours no arm. Every rank must pass the same arms in the same order (the forwards are collectives)."""
    names = list(arms)

    def once(name: str, timed_run: bool) -> Optional[float]:
        fn, before, after = arms[name]
        if before is not None:
            before()
        try:
            return timed(fn, device, barrier) if timed_run else fn()
        finally:
            if after is not None:
                after()

    for name in names:
        for _ in range(warmup):
            once(name, False)
    samples: dict = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            samples[name].append(once(name, True))
    return {n: median(v) for n, v in samples.items()}


def environment(device: torch.device, world: int) -> dict:
    """GPU model / count, torch / CUDA / NCCL / Triton / Python versions, git commit (and whether the tree is dirty),
    date: the provenance fields of the record."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 (a build without NCCL)
            nccl = None
    try:
        from importlib.metadata import version

        triton = version("triton")
    except Exception:  # noqa: BLE001 (not installed)
        triton = None
    commit, dirty = _git(["rev-parse", "HEAD"]) or "unknown", _git(["status", "--porcelain", "--untracked-files=no"])
    return {"gpu": {"model": gpu, "count": world if device.type == "cuda" else 0}, "git_commit": commit,
            "git_dirty": None if dirty is None else bool(dirty),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                         "nccl": nccl, "triton": triton}, "platform": platform.platform()}


def _git(argv: list) -> Optional[str]:
    """``git <argv>`` in the repository: its stdout, or None when git is missing or fails."""
    try:
        out = subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def gpu_slug(model: str, count: int) -> str:
    """``"NVIDIA H100 80GB HBM3"``, 4 -> ``4xh100``; ``cpu`` without a GPU (the file-name form of the records)."""
    import re

    if not model or model.lower() == "cpu" or count == 0:
        return "cpu"
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", model.upper().replace("NVIDIA", " "))
    slug = m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"{count}x{slug}" if count > 1 else slug


def make_record(*, benchmark: str, mode: str, what: str, rows: list, env: dict, command: str, params: dict,
                baselines: list, units: dict, notes: list, **extra: Any) -> dict:
    """The result record in the repository's benchmark schema (version 1: ``schema, subject, benchmark, mode, what,
    git_commit, git_dirty, date, gpu, versions, command, params, baselines, units, floor, rows, headline, notes``;
    ``benchmark/common/records.py`` where the checkout has it) plus this benchmark's ``extra`` sections (skipped
    layouts, auto-off candidates, single-rank verdicts). Raises ValueError when a baseline names no column."""
    columns = {k for r in rows for k in r}
    missing = [b for b in baselines if b not in columns]
    if missing:
        raise ValueError(f"baselines {missing} name no column of the rows")
    rec = {"schema": 1, "subject": "moe", "benchmark": benchmark, "mode": mode, "what": what,
           "git_commit": env["git_commit"], "git_dirty": env.get("git_dirty"), "date": env["date"], "gpu": env["gpu"],
           "versions": env["versions"], "platform": env.get("platform"), "command": command, "params": params,
           "baselines": baselines, "units": units, "floor": None, "rows": rows, "headline": [], "notes": notes}
    rec.update(extra)
    json.dumps(rec)  # TypeError here rather than a half-written file
    return rec


def write_record(record: dict, out_dir: Path, markdown: str) -> tuple[Path, Path]:
    """Write ``<date>_<what>_<gpu>.json`` and ``.md`` under ``out_dir``; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{record['date'][:10]}_{record['what']}_{gpu_slug(record['gpu']['model'], record['gpu']['count'])}"
    j, m = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    j.write_text(json.dumps(record, indent=1))
    m.write_text(markdown)
    return j, m


def command_line() -> str:
    """The command that ran this benchmark (for the record)."""
    return " ".join([os.path.basename(sys.executable)] + sys.argv)


def fmt(v: Any, digits: int = 3) -> str:
    """A table cell: floats with ``digits`` decimals, None as ``-``."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)
