"""The TokenWeave benchmark: one entry point, one mode per question (see ``benchmark/tokenweave/README.md``).

Usage (repository root)::

    python -m benchmark.tokenweave.bench --list
    python -m benchmark.tokenweave.bench layer --smoke                  # CPU, gloo, a shrunk shape
    python -m benchmark.tokenweave.bench e2e --dry-run --model-path M   # engine throughput on vs off
    python -m benchmark.tokenweave.bench timeline DIR/tokenweave_timeline_tokenweave_T4096.csv
    python -m benchmark.tokenweave.bench layer-fit --layer-fit L1.json L4.json  # fixed per-forward cost over layer counts
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: the repository root makes the benchmark package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmark.common.modes import Mode, run_mode  # noqa: E402

MODES = {
    "layer": Mode("benchmark.tokenweave.bench_layer",
                  "decoder layers of a real model shape at TP 2/4/8: TokenWeave vs nocomm / NCCL / NCCL symmetric / "
                  "custom all-reduce in the same run (eager, --cuda-graph, overlap profile)"),
    "e2e": Mode("benchmark.tokenweave.bench_e2e",
                "prefill-heavy sgl.Engine throughput with TokenWeave off and on, order-controlled, greedy equality"),
    "timeline": Mode("benchmark.tokenweave.overlap_timeline",
                     "where a TokenWeave forward's overlap goes: one kernel timeline CSV of the layer mode"),
    "layer-fit": Mode("benchmark.tokenweave.layer_report",
                      "fixed per-forward cost: least-squares fit of layer-mode results over layer counts"),
}


def main(argv=None) -> int:
    """Run the chosen mode with the rest of the command line."""
    return run_mode(MODES, sys.argv[1:] if argv is None else argv, prog="python -m benchmark.tokenweave.bench")


if __name__ == "__main__":
    sys.exit(main())
