"""tw-comm kernels registered as torch custom ops (``torch.ops.sgl_kernel.*``).

Each op runs on the caller's current CUDA stream, is CUDA-graph capturable (no host sync, fixed workspace
pointers; the kernels keep their epochs on the device), and takes ``max_sms``: the most thread blocks (SMs) the
kernels may use. ``handle`` is the opaque workspace handle owned by ``sglang.srt.distributed.tw_comm``.

Variants (TokenWeave, Gond et al. 2025, section 3.3, without NVLS): ONESHOT (P2P push + one barrier), TWOSHOT
(ReduceScatter by peer stores -> residual + RMSNorm on own 1/N rows -> AllGather by peer loads), CE (copy-engine
scatter/gather + reduce/norm kernel on max_sms SMs), LAMPORT (one-shot with the flag in the data), PIPE (the
two-shot with per-chunk flags: push, reduce + norm and pull of different chunks overlap), BULK (the two-shot whose
NVLink phases are Hopper bulk asynchronous copies through shared memory: few CTAs, many bytes in flight).
The NVLS variant is not an op: it is gated (see nvls_gate).
"""

from __future__ import annotations

import ctypes
from typing import Tuple

import torch

from sgl_kernel.tw_comm import reference
from sgl_kernel.tw_comm.lib import TW_OK, load_library

ONESHOT = 0
TWOSHOT = 1
CE = 2
LAMPORT = 3
PIPE = 4
BULK = 5
VARIANT_NAMES = {ONESHOT: "oneshot", TWOSHOT: "twoshot", CE: "ce", LAMPORT: "lamport", PIPE: "twoshot_pipe",
                 BULK: "twoshot_bulk"}


def dtype_code(dtype: torch.dtype) -> int:
    """tw-comm dtype code: 0 = bf16, 1 = fp16; ValueError otherwise."""
    if dtype == torch.bfloat16:
        return 0
    if dtype == torch.float16:
        return 1
    raise ValueError(f"dtype={dtype} is not supported; use torch.bfloat16 or torch.float16")


def _stream(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(t.device).cuda_stream)


def _p(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


@torch.library.custom_op("sgl_kernel::tw_allreduce_rmsnorm", mutates_args=("residual", "out"), device_types="cuda")
def tw_allreduce_rmsnorm(
    handle: int,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    variant: int,
    max_sms: int,
    residual_sharded: bool,
    chunk_bytes: int = 0,
) -> None:
    """residual += allreduce(x); out = rmsnorm(residual) * weight, across the workspace's ranks.

    x, residual, out: [T, H] bf16/fp16 CUDA, contiguous; weight [H]. variant: ONESHOT / TWOSHOT / CE / LAMPORT /
    PIPE / BULK (sm_90+). residual_sharded (TWOSHOT/PIPE/BULK/CE): update only this rank's token range of
    residual. chunk_bytes (PIPE): bytes of one peer's rows per pipeline chunk, 0 = the library default (32 KiB). Raises ValueError on a bad
    argument (checked in C), TwCommError on a CUDA failure.
    """
    launch_allreduce_rmsnorm(handle, x, residual, weight, out, eps, variant, max_sms, residual_sharded, chunk_bytes)


def launch_allreduce_rmsnorm(handle: int, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             out: torch.Tensor, eps: float, variant: int, max_sms: int, residual_sharded: bool,
                             chunk_bytes: int = 0) -> None:
    """The body of ``torch.ops.sgl_kernel.tw_allreduce_rmsnorm`` without the custom-op dispatcher (same
    arguments, same errors): eager callers on the hot path (TokenWeave issues 2 x layers calls per forward) skip
    the dispatcher's per-call host cost; traced/compiled code keeps using the op."""
    lib = load_library()
    T, H = x.shape
    dt = dtype_code(x.dtype)
    args = (ctypes.c_void_p(handle), _p(x), _p(residual), _p(weight), _p(out), T, H, dt, float(eps), max_sms)
    if variant == ONESHOT:
        lib.call("tw_oneshot_allreduce_rmsnorm", *args, _stream(x))
    elif variant == TWOSHOT:
        lib.call("tw_twoshot_allreduce_rmsnorm", *args, int(residual_sharded), _stream(x))
    elif variant == CE:
        lib.call("tw_ce_allreduce_rmsnorm", *args, int(residual_sharded), _stream(x))
    elif variant == LAMPORT:
        lib.call("tw_lamport_allreduce_rmsnorm", *args, _stream(x))
    elif variant == PIPE:
        lib.call("tw_twoshot_pipe_allreduce_rmsnorm", *args, int(residual_sharded), int(chunk_bytes), _stream(x))
    elif variant == BULK:
        lib.call("tw_twoshot_bulk_allreduce_rmsnorm", *args, int(residual_sharded), _stream(x))
    else:
        raise ValueError(f"variant={variant} must be ONESHOT (0), TWOSHOT (1), CE (2), LAMPORT (3), PIPE (4) or "
                         "BULK (5)")


@tw_allreduce_rmsnorm.register_fake
def _(handle, x, residual, weight, out, eps, variant, max_sms, residual_sharded, chunk_bytes=0) -> None:
    return None


@torch.library.custom_op("sgl_kernel::tw_allreduce", mutates_args=("out",), device_types="cuda")
def tw_allreduce(handle: int, x: torch.Tensor, out: torch.Tensor, variant: int, max_sms: int) -> None:
    """out = allreduce(x) (sum) across the workspace's ranks; variant ONESHOT or TWOSHOT; [T, H] bf16/fp16."""
    lib = load_library()
    T, H = x.shape
    lib.call("tw_allreduce", ctypes.c_void_p(handle), _p(x), _p(out), T, H, dtype_code(x.dtype), variant,
             max_sms, _stream(x))


@tw_allreduce.register_fake
def _(handle, x, out, variant, max_sms) -> None:
    return None


@torch.library.custom_op("sgl_kernel::tw_fused_add_rmsnorm", mutates_args=("residual", "out"))
def tw_fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float, max_sms: int
) -> None:
    """Local residual += x; out = rmsnorm(residual) * weight ([T, H]); CUDA kernel, or the torch reference on CPU."""
    if not x.is_cuda:
        new_res, normed = reference.add_rmsnorm_fp32(x.float(), residual, weight, eps)
        residual.copy_(new_res)
        out.copy_(normed)
        return
    T, H = x.shape
    load_library().call("tw_fused_add_rmsnorm", _p(x), _p(residual), _p(weight), _p(out), T, H,
                        dtype_code(x.dtype), float(eps), max_sms, _stream(x))


@tw_fused_add_rmsnorm.register_fake
def _(x, residual, weight, out, eps, max_sms) -> None:
    return None


def nvls_gate(device_index: int) -> Tuple[bool, str]:
    """(allowed, reason) from libtwcomm's NVLS gate: environment first, then the device's multicast support.

    Never creates a multicast object or runs a multimem instruction.
    """
    lib = load_library()
    rc = lib.raw("tw_nvls_gate", device_index)
    return rc == TW_OK, ("allowed" if rc == TW_OK else lib.last_error())
