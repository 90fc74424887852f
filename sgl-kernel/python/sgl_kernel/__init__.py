"""sgl_kernel: sglang-tw's kernels and communication library (tw-comm), below ``sglang`` in the import graph.

Subpackages (each imports on CPU-only machines; CUDA parts build or compile on first use on a GPU host):

* :mod:`sgl_kernel.tw_comm` -- TokenWeave's fused AllReduce + residual add + RMSNorm (ctypes binding of
  tw-comm's C API, JIT build, torch ops, argument validation, torch references);
* :mod:`sgl_kernel.m2n` -- MegaScale-Infer's many-to-many row exchange (M2N) and its payload transports;
* :mod:`sgl_kernel.tdist` -- Triton-distributed: symmetric heap, OpenSHMEM-style primitives, AG-GEMM / GEMM-RS;
* :mod:`sgl_kernel.triton` -- single-GPU Triton kernels (attention, norms, RoPE, MoE).

``sgl_kernel`` never imports ``sglang`` (``test/unit/test_layering.py`` checks it): what it needs from the serving
layer (e.g. the NIXL agent of :class:`sgl_kernel.m2n.nixl_transport.NixlTransport`, the environment of
:func:`sgl_kernel.tdist.spawn.run_ranks`) is passed in by the caller.
"""
