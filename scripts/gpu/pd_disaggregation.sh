#!/usr/bin/env bash
# PD disaggregation on ONE GPU: prefill and decode servers on the same GPU (each with --mem-fraction-static 0.2), KV
# moved by NIXL (UCX; CUDA IPC inside the node) when nixl imports, else by the fake backend; the end-to-end tests
# (greedy == aggregated, stream/batch/n/logprobs/stop, pull and push), then bench_pd_serving.py (router vs
# aggregated: TTFT, TPOT, transfer share of TTFT) on stories260K.
# Usage (repo root, shared data at ../shared/data): bash scripts/gpu/pd_disaggregation.sh [seconds, default 540]
# DRY_RUN=1 prints the commands. Logs: $OUT/pd_*.log; the bench's tables under $OUT.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"; budget_start "${1:-540}"
out="${OUT:-/tmp}" step_prefix=pd_ step_dry=${DRY_RUN:-} step_tail=30
backend=fake
if "$PY" -c "from sglang.srt.disaggregation.transfer.base import nixl_available as a; import sys; sys.exit(0 if a()[0] else 1)"; then
  backend=nixl
fi
echo "transfer backend: $backend"
step gpu_tests $(( $(left) * 60 / 100 )) env SGLANG_PD_TEST_DEVICE=cuda SGLANG_PD_TEST_BACKEND=$backend \
  "$PY" -m pytest -q -x test/integration/test_pd_disaggregation.py -p no:cacheprovider
step bench $(( $(left) - 10 )) "$PY" benchmark/disaggregation/bench_pd_serving.py --model-path ../shared/data/models/stories260K \
  --device cuda --transfer-backend $backend --server-extra "--mem-fraction-static 0.2" --num-prompts 64 \
  --max-concurrency 8 --out-dir "$out"
echo; printf '%s\n' "${summary[@]}"
