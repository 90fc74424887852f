"""GEMM SM carveout for TokenWeave's overlapped communication (Gond et al. 2025, sec. 3.2: the fused
AllReduce + RMSNorm runs on a few SMs *beside* the other split's compute).

Why it is needed: cuBLAS picks persistent GEMM kernels on Hopper for prefill shapes, with one CTA per SM that
loops over its output tiles. When such a GEMM starts first it holds every SM until its last tile, so the
communication kernel of the other split (high-priority stream or not) cannot start until the GEMM ends, and the
next GEMM then waits for the communication kernel's SMs: communication and compute serialize, and the overlap
hides nothing (2026-11-26 on 2 H100s: TokenWeave 1.03x / 1.00x of NCCL at 4096 / 8192 tokens while the
split itself cost nothing). Capping the GEMMs to ``num_sms - carveout`` SMs while the split forward runs leaves
the communication kernel's SMs free, so it starts as soon as its split's stage is done.

Both cuBLAS entry points PyTorch uses are capped: ``cublasSetSmCountTarget`` on the thread's cuBLAS handle
(``cublasGemmEx``, torch's default bf16 ``mm``) and ``torch._C._set_sm_carveout_experimental``
(``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`` of the cuBLASLt paths: ``addmm`` with bias, scaled mm). Both are
process state of the calling thread, so :class:`GemmCarveout` is a context manager that restores the previous
values on exit (also when the forward raises).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)
_TORCH_GET = getattr(torch._C, "_get_sm_carveout_experimental", None)
_TORCH_SET = getattr(torch._C, "_set_sm_carveout_experimental", None)


@functools.lru_cache(maxsize=1)
def _cublas() -> Optional[Any]:
    """ctypes handle of the libcublas that torch loaded (found in /proc/self/maps; call after
    ``torch.cuda.current_blas_handle()`` loaded it), or None (no CUDA, or no ``cublasSetSmCountTarget``)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libcublas.so" in ln and "libcublasLt" not in ln}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            fn = lib.cublasSetSmCountTarget
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
        return lib
    return None


class GemmCarveout:
    """Context manager: cuBLAS / cuBLASLt GEMMs issued by this thread on ``device`` target
    ``num_sms - carveout`` SMs inside the ``with`` block (see the module docstring).

    Args:
        carveout: SMs left to the overlapped communication kernel (0: nothing is changed).
        num_sms: the device's SM count.
        device: the CUDA device whose cuBLAS handle is capped (a non-CUDA device: no-op).
    Raises:
        ValueError: ``carveout`` outside ``[0, num_sms)``.
    """

    def __init__(self, carveout: int, num_sms: int, device: torch.device):
        if not 0 <= carveout < num_sms:
            raise ValueError(f"GEMM SM carveout={carveout} must be in [0, {num_sms}) (the SMs of the device)")
        self.carveout, self.num_sms, self.device = carveout, num_sms, torch.device(device)
        self.active = carveout > 0 and self.device.type == "cuda"
        self._prev_torch: Optional[int] = None
        self._handle: Optional[int] = None

    def __enter__(self) -> "GemmCarveout":
        if not self.active:
            return self
        if _TORCH_SET is not None:  # torch >= 2.6; older torch: only the cuBLAS handle is capped
            self._prev_torch = _TORCH_GET()
            _TORCH_SET(self.carveout)
        with torch.cuda.device(self.device):
            handle = torch.cuda.current_blas_handle()  # creates the handle (and loads libcublas) if needed
        lib = _cublas()
        if lib is not None:
            self._handle = handle
            rc = lib.cublasSetSmCountTarget(ctypes.c_void_p(self._handle), self.num_sms - self.carveout)
            if rc != 0:
                logger.warning("cublasSetSmCountTarget(%d) returned %d: cuBLAS GEMMs are not capped",
                               self.num_sms - self.carveout, rc)
                self._handle = None
        return self

    def __exit__(self, *exc) -> None:
        if not self.active:
            return
        if _TORCH_SET is not None:
            _TORCH_SET(self._prev_torch)
        if self._handle is not None:
            _cublas().cublasSetSmCountTarget(ctypes.c_void_p(self._handle), 0)  # 0: the library's default
            self._handle = None

