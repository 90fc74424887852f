#!/usr/bin/env bash
# Issue 28: docs/quickstart.md's GPU blocks run as written on TWO GPUs (nvidia-h100-x2): one GPU, TP 2 with
# TokenWeave, PD (prefill GPU 0, decode GPU 1, NIXL, router) and AFD (attention GPU 0, FFN GPU 1), with
# stories260K / stories260K-moe standing in for the downloaded checkpoints; each must answer the README request
# with English text. Usage (repo root, shared data at ../shared/data): bash scripts/gpu/issue28_quickstart_gpu.sh
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
out="${OUT:-/tmp}"
nvidia-smi -L 2>&1 | tee "$out/issue28_gpus.txt"
"$PY" -c "import nixl" 2>/dev/null && echo "nixl imports" || echo "WARNING: nixl does not import: the PD block will fail"
timeout 450 "$PY" -m pytest -q -rA test/gpu/test_docs_quickstart_gpu.py -p no:cacheprovider 2>&1 \
  | tee "$out/issue28_quickstart_gpu.log" | tail -25
echo "== summary"; grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed" "$out/issue28_quickstart_gpu.log" | tail -8
