"""Triton-distributed for sglang-tw: symmetric heap, OpenSHMEM-style Triton primitives and overlapped kernels.

Zheng et al., "Triton-distributed: Programming Overlapping Kernels on Distributed AI Systems with the Triton
Compiler" (2025), sec. 2-3. Layout (see docs/tdist.md):

* ``layout``      pure-Python heap bookkeeping (regions, signal slots, epochs, row splits) - CPU, no CUDA;
* ``cuda_ipc``    driver-API CUDA IPC used to build the heap (no multicast objects, ever);
* ``heap``        :class:`SymmetricHeap` (one per process group) and :func:`simulate_group` (N ranks in one process);
* ``primitives``  ``@triton.jit`` device functions (rank, symm_at, putmem, signal_op, wait, consume_token, ...);
* ``ag_gemm``, ``gemm_rs``, ``all_to_all``   kernels + host launchers; ``reference`` torch references.

Importing this package imports nothing heavy; submodules import Triton (CUDA-only modules in the layering sense).
"""
