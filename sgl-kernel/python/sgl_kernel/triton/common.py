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


def use_pdl(device: torch.device) -> bool:
    """Whether the decode-path Triton kernels (RMSNorm, RoPE + KV store, SiLU-and-mul, split-KV decode attention)
    launch with programmatic dependent launch (``SGLANG_DECODE_PDL=1``, Hopper or newer, not the interpreter):
    the launch carries ``cudaLaunchAttributeProgrammaticStreamSerialization`` (Triton's ``launch_pdl``) and the
    kernel's first instruction is ``griddepcontrol.wait`` (``tl.extra.cuda.gdc_wait``), so its launch and block
    set-up overlap the previous kernel's tail while every memory access still follows that kernel's completion
    (NVIDIA CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization"). Default off until the GPU
    A/B of issue 27 (``scripts/gpu/issue27_3_1gpu.sh``) decides. Read at launch: a CUDA graph keeps what it captured.

    Raises:
        ValueError: the variable is set to something other than 0 or 1.
    """
    val = os.environ.get(PDL_ENV, "0").strip()
    if val not in ("0", "1", ""):
        raise ValueError(f"{PDL_ENV}={val!r}: use 0 (plain launches) or 1 (programmatic dependent launch)")
    if val != "1" or interpreting() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9
