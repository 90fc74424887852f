"""Triton compute kernels (the one home of the project's Triton kernels; see docs/architecture.md, "Where kernels
live"): fused per-token ops (add+RMSNorm, RoPE, SiLU-and-mul, MoE routing and grouped GEMM) and paged attention
(split-KV decode, prefix-aware extend). Distributed Triton kernels live beside them in :mod:`sgl_kernel.tdist`.

Import only where ``triton`` is importable; :mod:`sglang.srt.layers.ops` and the attention backend are the
dispatching front ends (torch references otherwise). The old paths ``sglang.srt.layers.triton_ops.*`` and
``sglang.srt.layers.attention.triton_ops.*`` are aliases of these modules.
"""
