"""Triton kernels of the fused per-token ops (add+RMSNorm, RoPE, SiLU-and-mul, MoE routing and grouped GEMM).

Import this package only where ``triton`` is importable; :mod:`sglang.srt.layers.ops`
is the dispatching front end that falls back to the torch references.
"""
