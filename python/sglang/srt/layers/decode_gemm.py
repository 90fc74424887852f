"""Decode-GEMM autotune: per linear shape and decode batch bucket, cuBLAS or the fastest skinny config.

At decode every linear layer reads its whole weight for a handful of rows, so its time is the weight bytes over the
bandwidth it reaches. cuBLAS reaches ~0.9 of the copy bandwidth on the large Llama-3.1-8B projections but ~0.7 on
qkv / o_proj (too few tiles for the SMs). Rather than guess, the runner measures once on its own device, before
CUDA-graph capture: for each ``(N, K, dtype)`` of the model's :class:`~sglang.srt.layers.linear.LinearBase` layers
and LM head, and each batch bucket (:data:`BUCKETS` up to the largest captured size and ``SGLANG_DECODE_GEMM_MAX_M``),
it times ``F.linear`` (the default path) against a few :class:`~sgl_kernel.triton.skinny_gemm.SkinnyConfig` s inside
CUDA graphs, as decode runs them (CUDA events, warm-up, median of reps, cycling through the model's own weights of
that shape so L2 does not hold them), and keeps a skinny config only where it beat cuBLAS. The result is a frozen
:class:`DecodeGemmTable` that the :class:`~sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner` keeps and
hands to each linear layer and the LM head (:func:`install`); :func:`sglang.srt.layers.ops.linear` consults it per
call; a failed tune (e.g. out of memory) leaves everything on cuBLAS. Technique: empirical kernel selection
("autotuning", e.g. Whaley & Dongarra, "ATLAS", SC 1998) over the split-K weight-streaming GEMM of
:mod:`sgl_kernel.triton.skinny_gemm`.

Switch: ``SGLANG_DECODE_GEMM_AUTOTUNE`` (default on since it won every same-run A/B on two H100 runs, 2026-11-27:
served step / floor 1.259 -> 1.237, 1.222 -> 1.207, 1.200 -> 1.197 at batch 1 / 32 / 128; ``=0`` keeps every
linear on cuBLAS); CUDA only.

FP8 weights (:mod:`sglang.srt.layers.quantization`, per-channel schemes): their ``(N, K, "float8_e4m3fn")`` shapes
are tuned too, the reference being the layer's own W8A8 path (per-token activation quantization + ``torch._scaled_mm``
row-wise) and the candidates the weight-only streaming kernel :func:`sgl_kernel.triton.fp8.skinny_fp8_gemm` with the
same configs (activations in bf16); the layer's method consults the table per call
(:func:`sglang.srt.layers.quantization.fp8_ops.linear_per_channel`). Block-wise FP8 layers are not tuned.

Epilogue fusions (``SGLANG_DECODE_FUSE_EPILOGUE=1``, default OFF until a GPU A/B shows a win; see
:mod:`sglang.srt.layers.decode_fuse`): the table is then tuned with the fused forms where the model allows them
(:func:`sglang.srt.layers.decode_fuse.mark_model`): the projections feeding a fused add + RMSNorm time their skinny
configs without the split-K reduce kernel (the norm sums the partials; its extra read of ``S*M*N*4`` bytes is not
counted), and the dense MLPs' gate_up shapes time cuBLAS + the SiLU-and-mul kernel against split-K 1 skinny configs
with SiLU-and-mul in the epilogue. The table records it (``fuse_epilogue``) and :func:`install` sets the layers' flags
from it, so the same table always runs the forms it was timed with.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

AUTOTUNE_ENV = "SGLANG_DECODE_GEMM_AUTOTUNE"
MAX_M_ENV = "SGLANG_DECODE_GEMM_MAX_M"
BUCKETS = (1, 8, 16, 32, 64, 128)  # a bucket is timed at its top M and covers (previous bucket, top]
Shape = Tuple[int, int, str]  # (N, K, dtype name)


@dataclass(frozen=True)
class GemmChoice:
    """The measured outcome for one (shape, bucket): ``config`` None means cuBLAS (``F.linear``).

    Attributes: m_max (bucket top, rows), config, cublas_us / skinny_us (median microseconds per call at m_max;
    skinny_us of the best skinny config, None if none ran), skinny_config (that config, chosen or not), fused (issue
    27: the form both were timed in: "" plain, "partials" = skinny without its split-K reduce, "silu" = cuBLAS +
    SiLU-and-mul vs the gate_up skinny GEMM with SiLU-and-mul in its epilogue).
    """

    m_max: int
    config: Optional[object]
    cublas_us: float
    skinny_us: Optional[float]
    skinny_config: Optional[object]
    fused: str = ""  # epilogue fusion: "" plain, "partials" (split-K reduce in the next norm), "silu" (gate_up + SiLU)


@dataclass(frozen=True)
class DecodeGemmTable:
    """Frozen per-device dispatch table: ``entries`` maps ``(N, K, dtype name)`` to its :class:`GemmChoice` s,
    ascending ``m_max``. Built by :func:`autotune`; read by :meth:`lookup` (host side, at graph capture or eager
    forward). ``fuse_epilogue``: tuned with the decode epilogue fusions, which :func:`install` then switches on."""

    device_name: str
    entries: Tuple[Tuple[Shape, Tuple[GemmChoice, ...]], ...]
    tune_s: float = 0.0
    fuse_epilogue: bool = False  # tuned with (and installs) the decode epilogue fusions
    _index: Dict[Shape, Tuple[GemmChoice, ...]] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_index", dict(self.entries))

    def lookup(self, n: int, k: int, dtype: torch.dtype, m: int):
        """The :class:`~sgl_kernel.triton.skinny_gemm.SkinnyConfig` for an ``[m, k] x [n, k]^T`` GEMM of ``dtype``,
        or None (use cuBLAS): unknown shape, m beyond the last bucket, or cuBLAS won the bucket."""
        for c in self._index.get((n, k, str(dtype).replace("torch.", "")), ()):
            if m <= c.m_max:
                return c.config
        return None

    def describe(self) -> List[str]:
        """One line per (shape, bucket): times and the choice, for the log."""
        out = []
        for (n, k, dt), choices in self.entries:
            base = "scaled_mm" if is_fp8(dt) else "cublas"  # FP8 shapes: the W8A8 path (quantize + _scaled_mm)
            for c in choices:
                sk = f"{c.skinny_us:.1f} us ({c.skinny_config})" if c.skinny_us is not None else "-"
                tag = {"partials": " [fused: reduce in norm]", "silu": " [fused: +silu]"}.get(c.fused, "")
                out.append(f"N={n} K={k} {dt} M<={c.m_max}: {base} {c.cublas_us:.1f} us, skinny {sk} -> "
                           f"{c.config if c.config is not None else base}{tag}")
        return out


def is_fp8(dtype_name: str) -> bool:
    """Whether a shape's dtype name (``str(dtype)`` without ``torch.``) is an FP8 weight (tuned with the FP8 paths)."""
    return dtype_name.startswith("float8")


def enabled(device: torch.device) -> bool:
    """True when ``device`` is CUDA and ``SGLANG_DECODE_GEMM_AUTOTUNE`` is unset (the default) or not 0."""
    return torch.device(device).type == "cuda" and os.environ.get(AUTOTUNE_ENV, "1") not in ("", "0")


def max_m_from_env() -> int:
    """``SGLANG_DECODE_GEMM_MAX_M`` (default 128, the skinny kernel's limit). Raises ValueError outside 1..128."""
    raw = os.environ.get(MAX_M_ENV, "128")
    try:
        val = int(raw)
    except ValueError:
        val = -1
    if not 1 <= val <= 128:
        raise ValueError(f"{MAX_M_ENV}={raw!r}: need an integer in 1..128")
    return val


def buckets_for(batch_sizes: Sequence[int], max_m: int) -> List[int]:
    """The :data:`BUCKETS` needed for ``batch_sizes`` (the captured decode sizes): up to the bucket covering the
    largest size <= ``max_m``."""
    top = max([b for b in batch_sizes if b <= max_m], default=0)
    out = []
    for b in BUCKETS:
        if top < 1:
            break
        out.append(b)
        if b >= top:
            break
    return out


def _fill_split(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """Smallest split-K in 1, 2, 4, 8 whose ``cdiv(n, block_n) * split`` programs cover the SMs, keeping >= 2
    K-tiles per split."""
    tiles = -(-n // block_n)
    split = 1
    while tiles * split < num_sms and split < 8 and k >= 4 * split * block_k:
        split *= 2
    return split


def candidates(m: int, n: int, k: int, num_sms: int) -> List[object]:
    """Skinny configs worth timing at ``m`` rows for an ``[n, k]`` weight on a ``num_sms``-SM device: a few tiles per
    padded-M class (16-byte loads: block_k >= 64), each at split 1 and at the split that fills the SMs."""
    from sgl_kernel.triton.skinny_gemm import SkinnyConfig

    if m <= 16:
        tiles = ((16, 512, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4))
    elif m <= 32:  # + a wide strip: x (L2-resident) is re-read once per N strip, so fewer strips read less of it;
        # + small-footprint tiles (64 / 96 KiB of shared memory: 2-3 programs per SM), so qkv / o_proj (96-192
        # strips, not a multiple of 132 SMs) run as one resident wave (measured: both at ~0.78 of bandwidth)
        tiles = ((32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (32, 128, 4, 4),
                 (16, 256, 4, 4))
    elif m <= 64:
        tiles = ((64, 128, 4, 4), (64, 256, 8, 3), (128, 128, 8, 3))
    else:  # + 256-row strips (48 KiB per stage): half the x re-reads of 128, split-K fills the SMs where N is small
        tiles = ((64, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4), (256, 64, 8, 3))
    out = []
    for bn, bk, warps, stages in tiles:
        for split in sorted({1, _fill_split(n, k, bn, bk, num_sms)}):
            out.append(SkinnyConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages))
    return out


def _graph_of(run: Callable[[], object]) -> Optional[Callable[[], object]]:
    """``run`` captured in a CUDA graph (its replay), after one warm-up on a side stream; None if capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        return graph.replay
    except RuntimeError as e:  # e.g. an op that cannot be captured: time it eagerly instead
        logger.info("decode GEMM tune: CUDA-graph capture failed (%s); timing eagerly", e)
        torch.cuda.synchronize()
        return None


def time_per_call_us(fn: Callable[[torch.Tensor], object], weights: Sequence[torch.Tensor], reps: int = 5) -> float:
    """Median microseconds per ``fn(w)`` call over ``reps`` CUDA-event-timed replays of one CUDA graph holding a pass
    through ``weights`` (as a decode step replays them: no host launch cost; cycling distinct weights keeps them out
    of L2); one eager pass (compile) and one replay warm up first. Eager passes if capture fails."""
    def run():
        for w in weights:
            fn(w)

    run()
    torch.cuda.synchronize()
    run = _graph_of(run) or run
    run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(weights))
    return statistics.median(times)


def _silu_candidates(cfgs: Sequence[object]) -> List[object]:
    """The gate_up + SiLU forms of ``cfgs``: split-K 1 (the epilogue is not linear), ``block_n`` halved (a program
    holds ``block_n`` gate and ``block_n`` up rows: the same weight bytes per pipeline stage), duplicates dropped."""
    from sgl_kernel.triton.skinny_gemm import SkinnyConfig

    out = []
    for c in cfgs:
        cfg = SkinnyConfig(block_n=max(16, c.block_n // 2), block_k=c.block_k, split_k=1, num_warps=c.num_warps,
                           num_stages=c.num_stages)
        if cfg not in out:
            out.append(cfg)
    return out


def _tune_fns(fused: str, fp8_scale: Optional[torch.Tensor] = None):
    """(reference(x, w), skinny(x, w, cfg), candidates(cfgs)) timed for a shape in ``fused`` mode ("" / "partials" /
    "silu"); with ``fp8_scale`` (a [N] fp32 scale) the FP8 pair: the W8A8 path vs the weight-only streaming kernel."""
    from sgl_kernel.triton.activation import silu_and_mul
    from sgl_kernel.triton.decode_fuse import skinny_gemm_silu
    from sgl_kernel.triton.skinny_gemm import skinny_gemm, skinny_gemm_partials

    if fp8_scale is not None:
        from sgl_kernel.triton.fp8 import skinny_fp8_gemm

        from sglang.srt.layers.quantization.fp8_ops import linear_per_channel

        return (lambda x, w: linear_per_channel(x, w, fp8_scale),
                lambda x, w, c: skinny_fp8_gemm(x, w, fp8_scale, **c.kwargs()), list)
    if fused == "silu":  # cuBLAS + the SiLU-and-mul kernel vs the fused epilogue
        return (lambda x, w: silu_and_mul(F.linear(x, w)), lambda x, w, c: skinny_gemm_silu(x, w, **c.kwargs()),
                _silu_candidates)
    kern = skinny_gemm_partials if fused == "partials" else skinny_gemm
    return F.linear, lambda x, w, c: kern(x, w, **c.kwargs()), list


def _tune_shape(shape: Shape, weights: Sequence[torch.Tensor], buckets: Sequence[int], num_sms: int,
                gen: torch.Generator, fused: str = "") -> Tuple[GemmChoice, ...]:
    n, k, dt = shape
    fp8 = is_fp8(dt)
    ref, skinny, forms = _tune_fns(fused, torch.ones(n, dtype=torch.float32, device=weights[0].device)
                                   if fp8 else None)
    act_dtype = torch.bfloat16 if fp8 else weights[0].dtype  # FP8 layers take bf16 activations
    choices = []
    for m in buckets:
        x = torch.randn(m, k, generator=gen, device="cpu").to(act_dtype).to(weights[0].device)
        cublas = time_per_call_us(lambda w: ref(x, w), weights)
        best, best_cfg = None, None
        for cfg in forms(candidates(m, n, k, num_sms)):
            try:
                t = time_per_call_us(lambda w: skinny(x, w, cfg), weights)
            except Exception as e:  # a config that does not compile/launch here (e.g. shared memory): skip it
                logger.info("decode GEMM tune: N=%d K=%d M=%d %s failed: %s: %s", n, k, m, cfg, type(e).__name__, e)
                continue
            if best is None or t < best:
                best, best_cfg = t, cfg
        chosen = best_cfg if best is not None and best < cublas else None
        choices.append(GemmChoice(m_max=m, config=chosen, cublas_us=cublas, skinny_us=best, skinny_config=best_cfg,
                                  fused=fused))
    return tuple(choices)


def autotune(weights_by_shape: Dict[Shape, List[torch.Tensor]], buckets: Sequence[int], device: torch.device,
             seed: int = 0, deferred: Sequence[Shape] = (), gated: Sequence[Shape] = (),
             fuse_epilogue: bool = False) -> DecodeGemmTable:
    """Measure cuBLAS vs the skinny candidates for every shape and bucket on ``device`` (CUDA) and return the table.

    Args:
        weights_by_shape: ``(N, K, dtype name)`` -> weights ``[N, K]`` on ``device`` (the model's own; all are
            cycled through per timing pass).
        buckets: bucket tops (rows), ascending, each <= 128.
        device: the CUDA device.
        deferred, gated, fuse_epilogue: epilogue fusions (:mod:`sglang.srt.layers.decode_fuse`): with
            ``fuse_epilogue`` the shapes in ``gated`` are timed as gate_up + SiLU-and-mul and those in ``deferred``
            without the split-K reduce; the table records ``fuse_epilogue``.
    Raises:
        ValueError: a non-CUDA device or a bucket outside 1..128.
    """
    device = torch.device(device)
    if device.type != "cuda" or any(not 1 <= b <= 128 for b in buckets):
        raise ValueError(f"decode GEMM autotune: device {device}, buckets {list(buckets)}: need CUDA and 1..128")
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    with torch.cuda.device(device), torch.inference_mode():
        def mode(shape: Shape) -> str:
            if not fuse_epilogue:
                return ""
            return "silu" if shape in gated else "partials" if shape in deferred else ""

        entries = tuple((shape, _tune_shape(shape, ws, buckets, num_sms, gen, mode(shape)))
                        for shape, ws in sorted(weights_by_shape.items()))
        torch.cuda.empty_cache()  # the timing graphs' transient outputs
    return DecodeGemmTable(device_name=torch.cuda.get_device_name(device), entries=entries,
                           tune_s=time.perf_counter() - t0, fuse_epilogue=fuse_epilogue)


def model_linear_weights(model: torch.nn.Module) -> Dict[Shape, List[torch.Tensor]]:
    """``(N, K, dtype name)`` -> the distinct 2-D bf16/fp16 weights of ``model``'s LinearBase layers and vocabulary
    tables (the LM head, tied or not, is one of them) of that shape, and the e4m3 weights of FP8 layers whose method
    offers them to the tuner (``quant_method.decode_gemm_operands``: per-channel schemes)."""
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    out: Dict[Shape, List[torch.Tensor]] = {}
    seen = set()
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        qm = getattr(mod, "quant_method", None)
        if qm is not None:
            ops_ = qm.decode_gemm_operands(mod)
            w = ops_[0] if ops_ is not None and ops_[0].dtype == torch.float8_e4m3fn else None
        if isinstance(mod, (LinearBase, VocabParallelEmbedding)) and isinstance(w, torch.Tensor) and w.dim() == 2 \
                and w.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn) and w.stride(-1) == 1 \
                and id(w) not in seen:
            seen.add(id(w))
            out.setdefault((w.shape[0], w.shape[1], str(w.dtype).replace("torch.", "")), []).append(w)
    return out


def install(model: torch.nn.Module, table: Optional[DecodeGemmTable]) -> int:
    """Hand ``table`` (None: remove) to every LinearBase and LogitsProcessor (the LM-head projection) of ``model``;
    returns how many modules got it. Sets (or clears) the decode epilogue-fusion flags from
    ``table.fuse_epilogue`` (:func:`sglang.srt.layers.decode_fuse.mark_model`)."""
    from sglang.srt.layers.decode_fuse import mark_model
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.logits_processor import LogitsProcessor

    mark_model(model, bool(getattr(table, "fuse_epilogue", False)))

    count = 0
    for mod in model.modules():
        if isinstance(mod, (LinearBase, LogitsProcessor)):
            mod.decode_gemm = table
            count += 1
    return count


def maybe_autotune(model: torch.nn.Module, batch_sizes: Sequence[int], device: torch.device,
                   rank: int = 0, fuse_ok: bool = True) -> Optional[DecodeGemmTable]:
    """The runner's entry point: when :func:`enabled`, tune the model's linear shapes for the buckets covering
    ``batch_sizes``, log the table once (this rank) and return it; else None (every linear stays on cuBLAS).
    ``fuse_ok``: the caller's executor runs the model's plain layer order (the sequential one), so the decode
    epilogue fusions may be tuned when ``SGLANG_DECODE_FUSE_EPILOGUE=1`` (ValueError for a bad value)."""
    from sglang.srt.layers.decode_fuse import fuse_enabled, mark_model

    if not enabled(device):
        return None
    buckets = buckets_for(batch_sizes, max_m_from_env())
    weights = model_linear_weights(model)
    if not buckets or not weights:
        return None
    fuse = fuse_ok and fuse_enabled()
    deferred, gated = mark_model(model, fuse)
    fuse = fuse and bool(deferred or gated)
    try:
        table = autotune(weights, buckets, device, deferred=sorted(deferred), gated=sorted(gated),
                         fuse_epilogue=fuse)
    except (RuntimeError, ValueError) as e:  # e.g. out of memory: fail closed to cuBLAS, never to eager decode
        logger.warning("rank %d: decode GEMM autotune failed (%s: %s); every linear stays on cuBLAS", rank,
                       type(e).__name__, e)
        torch.cuda.empty_cache()
        return None
    picked = sum(c.config is not None for _, cs in table.entries for c in cs)
    if table.fuse_epilogue:
        from sglang.srt.layers.decode_fuse import kernels_saved

        logger.info("rank %d: decode epilogue fusions, kernels removed per forward: %s", rank,
                    ", ".join(f"{kernels_saved(model, table, b)} at M<={b}" for b in buckets))
    logger.info("rank %d: decode GEMM autotune on %s in %.1f s%s: %d of %d (shape, bucket) pairs use the skinny "
                "kernel\n  %s", rank, table.device_name, table.tune_s,
                " (epilogue fusions on)" if table.fuse_epilogue else "", picked,
                sum(len(cs) for _, cs in table.entries), "\n  ".join(table.describe()))
    return table
