#!/usr/bin/env bash
# PD disaggregation (issue 13) on ONE GPU: prefill and decode servers on the same GPU (each with
# --mem-fraction-static 0.2), KV moved by NIXL (UCX; CUDA IPC inside the node) when nixl imports, else by the
# fake backend; the CPU end-to-end tests (greedy == aggregated, stream/batch/n/logprobs/stop, pull and push)
# then benchmark/disaggregation/bench_pd_serving.py (router vs aggregated: TTFT, TPOT, transfer share of TTFT) on stories260K.
# Usage (repo root, shared data at ../shared/data): bash scripts/gpu/pd_disaggregation.sh [seconds, default 540]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"; budget_start "${1:-540}"  # left: seconds of it left
out="${OUT:-/tmp}"
backend=fake
if python3 -c "from sglang.srt.disaggregation.transfer.base import nixl_available as a; import sys; sys.exit(0 if a()[0] else 1)"; then
  backend=nixl
fi
echo "== PD tests on cuda, transfer backend $backend"
SGLANG_PD_TEST_DEVICE=cuda SGLANG_PD_TEST_BACKEND=$backend timeout $(( $(left) * 60 / 100 )) \
  python3 -m pytest -q -x test/integration/test_pd_disaggregation.py -p no:cacheprovider 2>&1 \
  | tee "$out/pd_gpu_tests.log" | tail -30
echo "== bench_pd_serving (stories260K, ShareGPT, $backend)"
timeout $(( $(left) - 10 )) python3 benchmark/disaggregation/bench_pd_serving.py --model-path ../shared/data/models/stories260K \
  --device cuda --transfer-backend $backend --server-extra "--mem-fraction-static 0.2" --num-prompts 64 \
  --max-concurrency 8 --out-dir "$out" 2>&1 | tail -20
