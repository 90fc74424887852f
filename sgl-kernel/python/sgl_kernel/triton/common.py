"""Small host-side helpers shared by the Triton kernels' launch wrappers."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    The Triton 3.9 interpreter computes ``tl.dot`` on bf16 operands wrongly
    (it multiplies the raw 16-bit patterns); kernels take a ``DOT_F32``
    constexpr set from this function and upcast their dot operands to fp32
    when it is True. On a GPU the operands stay in bf16/fp16 (tensor cores).
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def check_cuda_or_interpret(*tensors: torch.Tensor, what: str) -> None:
    """Raise ValueError unless every tensor is on CUDA or the Triton interpreter is active.

    Raises:
        ValueError: a CPU tensor without ``TRITON_INTERPRET=1`` (use the torch reference in
            :mod:`sglang.srt.layers.ops` instead).
    """
    if interpreting():
        return
    for t in tensors:
        if not t.is_cuda:
            raise ValueError(f"{what}: Triton kernels need CUDA tensors, got one on {t.device}; "
                             "call sglang.srt.layers.ops (torch fallback) or set TRITON_INTERPRET=1")


PDL_ENV = "SGLANG_DECODE_PDL"
#: GPU models (substrings of ``torch.cuda.get_device_name``) where ``SGLANG_DECODE_PDL`` unset means on: the
#: same-run A/Bs measured PDL faster than plain launches on an H100 (served step -0.113 / -0.070 ms at batch 32 /
#: 128, ``benchmark/results/archive/decode/2026-11-27_switch_ab_0322utc_h100.md``) and slower on an H200 (+0.148 / +0.149 ms at batch
#: 32 / 1, ``benchmark/results/archive/decode/2026-11-27_switch_ab_0336utc_h200.md``); unmeasured models keep plain launches.
PDL_DEFAULT_ON_MODELS = ("H100",)


@functools.lru_cache(maxsize=None)
def triton_has_launch_pdl() -> bool:
    """Whether this Triton's CUDA backend accepts the ``launch_pdl`` launch option (Triton >= 3.4); False when the
    NVIDIA backend is missing (e.g. a ROCm or CPU-only build)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # no NVIDIA backend: plain launches
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def use_pdl(device: torch.device) -> bool:
    """Whether the decode-path Triton kernels (RMSNorm, RoPE + KV store, SiLU-and-mul, split-KV decode attention,
    skinny GEMM and its split-K reduce) launch with programmatic dependent launch (``SGLANG_DECODE_PDL=2`` on,
    ``=0`` off; unset: on for the GPU models of :data:`PDL_DEFAULT_ON_MODELS`, where it measured faster, off
    elsewhere). Each such launch carries
    ``cudaLaunchAttributeProgrammaticStreamSerialization`` (Triton's ``launch_pdl``); the kernel's first instruction
    is ``griddepcontrol.wait`` (``tl.extra.cuda.gdc_wait``), which waits for the full completion and memory flush of
    the previous grid, so every memory access still follows that kernel; right after the wait it issues
    ``griddepcontrol.launch_dependents``, so the next kernel launches (and sets up its blocks) while this one runs;
    and the skinny GEMM pulls the first K columns of its weight strip into L2 before its wait (weights are never
    written by an earlier kernel of the step), so the weight stream starts during the previous kernel (NVIDIA CUDA
    Programming Guide, "Programmatic Dependent Launch and Synchronization"). The one-GPU A/B
    (``benchmark/results/archive/decode/2026-11-27_switch_ab_0322utc_h100.md``) measured the served decode step 0.113 / 0.070 ms
    faster at batch 32 / 128 than plain launches on an H100 (+0.027 ms at batch 1, within noise), and an H200 run
    (2026-11-27) measured it 0.15 ms slower at batch 1 and 32, hence the per-model default; the former
    ``=1`` mode (wait only, no early launch or prefetch) was dominated by this one and was removed.

    Off (plain launches) in the Triton interpreter, on non-CUDA devices or ROCm, below Hopper (compute capability 9),
    or when Triton lacks the ``launch_pdl`` option. Read at launch: a CUDA graph keeps what it captured. Callers pass
    it as the kernels' ``USE_GDC`` constexpr.

    Raises:
        ValueError: the variable is set to something other than 0 or 2 (``1``, the removed wait-only mode, included).
    """
    val = os.environ.get(PDL_ENV, "").strip()
    if val not in ("0", "2", ""):
        raise ValueError(f"{PDL_ENV}={val!r}: use 0 (plain launches) or 2 (programmatic dependent launch with early "
                         "launch of the next kernel and L2 weight prefetch, the default; unset means 2); the "
                         "wait-only mode 1 was removed")
    if val == "0" or interpreting() or device.type != "cuda" or torch.version.hip is not None:
        return False
    if torch.cuda.get_device_capability(device)[0] < 9 or not triton_has_launch_pdl():
        return False
    return val == "2" or _pdl_default_on(torch.cuda.get_device_name(device))


@functools.lru_cache(maxsize=None)
def _pdl_default_on(gpu_name: str) -> bool:
    """Whether ``SGLANG_DECODE_PDL`` unset means on for this GPU model (:data:`PDL_DEFAULT_ON_MODELS`)."""
    return any(m in gpu_name for m in PDL_DEFAULT_ON_MODELS)
