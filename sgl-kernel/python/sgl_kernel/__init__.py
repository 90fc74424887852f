"""sgl_kernel: sglang-tw's kernels exposed as torch ops.

Imports on CPU-only machines: the CUDA parts (tw-comm's library) are built JIT with nvcc on first use on a GPU
host (see :mod:`sgl_kernel.tw_comm_build`), and every op has a torch reference in :mod:`sgl_kernel.reference`.
"""

from sgl_kernel import reference
from sgl_kernel.tw_comm_validate import (
    MAX_HIDDEN,
    SUPPORTED_DTYPES,
    validate_allreduce,
    validate_allreduce_rmsnorm,
)

__all__ = [
    "MAX_HIDDEN",
    "SUPPORTED_DTYPES",
    "reference",
    "validate_allreduce",
    "validate_allreduce_rmsnorm",
]
