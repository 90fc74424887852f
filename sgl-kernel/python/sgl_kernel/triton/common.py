"""Small host-side helpers shared by the Triton kernels' launch wrappers."""

from __future__ import annotations

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


EARLY_LOADS_ENV = "SGLANG_DECODE_EARLY_LOADS"


def early_loads() -> bool:
    """Whether the small per-layer kernels (RMSNorm, RoPE + KV store) issue all their independent global loads
    before their first store (``SGLANG_DECODE_EARLY_LOADS=1``; default off until the GPU A/B of issue 27,
    ``scripts/gpu/issue27_3_1gpu.sh``, decides). Read at launch, so a CUDA graph keeps the variant it captured.

    Raises:
        ValueError: the variable is set to something other than 0 or 1.
    """
    val = os.environ.get(EARLY_LOADS_ENV, "0").strip()
    if val not in ("0", "1", ""):
        raise ValueError(f"{EARLY_LOADS_ENV}={val!r}: use 0 (loads in program order) or 1 (loads first)")
    return val == "1"


PDL_ENV = "SGLANG_DECODE_PDL"


def use_pdl(device: torch.device) -> int:
    """The programmatic-dependent-launch mode of the decode-path Triton kernels (RMSNorm, RoPE + KV store,
    SiLU-and-mul, split-KV decode attention, skinny GEMM): 0 plain launches; 1 (``SGLANG_DECODE_PDL=1``) the launch
    carries ``cudaLaunchAttributeProgrammaticStreamSerialization`` (Triton's ``launch_pdl``) and the kernel's first
    instruction is ``griddepcontrol.wait`` (``tl.extra.cuda.gdc_wait``), so its launch and block set-up overlap the
    previous kernel's tail while every memory access still follows that kernel's completion (NVIDIA CUDA
    Programming Guide, "Programmatic Dependent Launch and Synchronization"); 2 (``SGLANG_DECODE_PDL=2``, issue 27
    item 2) as 1, and each kernel also issues ``griddepcontrol.launch_dependents`` right after its wait, so the next
    kernel launches while this one runs (not at its end), and the skinny GEMM pulls the first K columns of its
    weight strip into L2 before its wait (weights are never written by an earlier kernel of the step): the weight
    stream starts during the previous kernel instead of after a launch + first-load bubble. Correctness is as in 1:
    ``griddepcontrol.wait`` waits for the full completion and memory flush of the previous grid. Hopper or newer,
    not the interpreter (else 0). Default 0 until the GPU A/B of issue 27 (``scripts/gpu/issue27_3_1gpu.sh``)
    decides. Read at launch: a CUDA graph keeps what it captured. Callers use it as a truth value (PDL or not) and
    pass it as the kernels' ``USE_GDC`` constexpr.

    Raises:
        ValueError: the variable is set to something other than 0, 1 or 2.
    """
    val = os.environ.get(PDL_ENV, "0").strip()
    if val not in ("0", "1", "2", ""):
        raise ValueError(f"{PDL_ENV}={val!r}: use 0 (plain launches), 1 (programmatic dependent launch) or 2 "
                         "(1 + early launch of the next kernel and L2 weight prefetch in the skinny GEMM)")
    if val in ("0", "") or interpreting() or device.type != "cuda":
        return 0
    return int(val) if torch.cuda.get_device_capability(device)[0] >= 9 else 0
