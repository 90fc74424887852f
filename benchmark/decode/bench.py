"""The decode benchmark: one entry point, one mode per question. Every mode measures against a floor or a baseline
taken in the same process (see ``benchmark/decode/README.md``).

Usage (repository root)::

    python -m benchmark.decode.bench --list
    python -m benchmark.decode.bench step --out /tmp/out --serving --breakdown     # one GPU
    python -m benchmark.decode.bench host --device cpu                             # no GPU needed
    python benchmark/decode/bench.py step --help                                   # a mode's own options
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: the repository root makes the benchmark package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmark.common.modes import Mode, run_mode  # noqa: E402

MODES = {
    "step": Mode("benchmark.decode.step_ab",
                 "decode step and 8K prefill vs the memory / matmul floors; host path old vs new in one process; "
                 "--serving, --switch-ab SPEC, --gemm-ab for the served step, kernel switches and the decode GEMM"),
    "host": Mode("benchmark.decode.host_step", "host time of one decode step around the graph replay, old vs new (CPU)"),
    "gemm-tune": Mode("benchmark.decode.gemm_tune", "decode GEMMs: cuBLAS vs the best skinny config per shape, "
                      "against copy bandwidth"),
    "gemm-kernels": Mode("benchmark.decode.gemm_kernels", "decode-sized GEMM kernels timed inside CUDA graphs"),
    "attention-kernels": Mode("benchmark.decode.attention_rope_kernels",
                              "split-KV decode attention and RoPE + KV store, old vs new kernels in one run"),
    "attention-configs": Mode("benchmark.decode.attention_configs",
                              "decode attention tile configs timed inside a CUDA graph"),
    "profile": Mode("benchmark.decode.profile_step", "where a decode step's time goes: kernels vs host, top kernels"),
    "run-report": Mode("benchmark.decode.gpu_run_report",
                         "lay one GPU run's outputs (step, host, extend configs, serving) into one markdown file"),
}


def main(argv=None) -> int:
    """Run the chosen mode with the rest of the command line."""
    return run_mode(MODES, sys.argv[1:] if argv is None else argv, prog="python -m benchmark.decode.bench")


if __name__ == "__main__":
    sys.exit(main())
