"""tw-comm's Python side (TokenWeave, Gond et al. 2025, sec. 3.3: fused AllReduce + residual add + RMSNorm).

* :mod:`.lib` -- ctypes binding of the C API (``tw-comm/include/tw_comm/tw_comm.h``);
* :mod:`.build` -- the JIT nvcc build of ``tw-comm/`` (cached by content hash);
* :mod:`.ops` -- the kernels registered as torch custom ops (``torch.ops.sgl_kernel.*``, CPU fallbacks);
* :mod:`.validate` -- argument validation shared by the ops and ``sglang.srt.distributed.tw_comm``;
* :mod:`.reference` -- fp32 torch references (CPU path and test oracles).

Importing this package loads neither the library nor CUDA.
"""

from sgl_kernel.tw_comm import reference
from sgl_kernel.tw_comm.validate import MAX_HIDDEN, SUPPORTED_DTYPES, validate_allreduce, validate_allreduce_rmsnorm

__all__ = ["MAX_HIDDEN", "SUPPORTED_DTYPES", "reference", "validate_allreduce", "validate_allreduce_rmsnorm"]
