#!/usr/bin/env bash
# PD push mode's layerwise KV writes on ONE GPU:
#  1. the @gpu unit test: per-layer CUDA events order each layer's WRITE behind its KV store, the forward's host
#     thread never blocks per layer (test/unit/test_pd_layerwise_push.py);
#  2. the end-to-end layerwise / after-the-fact push test on cuda (prefill and decode servers on the same GPU,
#     --mem-fraction-static 0.2) when nixl imports (the fake backend copies host memory only);
#  3. benchmark/disaggregation/bench_push_layerwise.py (layerwise vs after the forward, synthetic staged model), two shapes.
# Usage (repo root, shared data at ../shared/data): bash scripts/gpu/pd_push_layerwise.sh [seconds, default 300]
# DRY_RUN=1 prints the commands. Logs: $OUT/pd_push_*.log.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"; budget_start "${1:-300}"
out="${OUT:-/tmp}" step_prefix=pd_push_ step_dry=${DRY_RUN:-} step_tail=20
step unit 120 "$PY" -m pytest -q -x test/unit/test_pd_layerwise_push.py -p no:cacheprovider
bk=fake; dev=cpu
if "$PY" -c "from sglang.srt.disaggregation.transfer.base import nixl_available as a; import sys; sys.exit(0 if a()[0] else 1)"; then
  bk=nixl; dev=cuda
  step e2e $(( $(left) - 60 )) env SGLANG_PD_TEST_DEVICE=cuda SGLANG_PD_TEST_BACKEND=nixl \
    "$PY" -m pytest -q -x test/integration/test_pd_push_layerwise.py -p no:cacheprovider
else
  summary+=("e2e: not run (nixl does not import: pip install nixl-cu12 or nixl-cu13)")
fi
step bench_2k 120 "$PY" benchmark/disaggregation/bench_push_layerwise.py --device $dev --backend $bk --tokens 2048 --hidden 1024 \
  --mlp-iters 1 --out-dir "$out"
step bench_4k 120 "$PY" benchmark/disaggregation/bench_push_layerwise.py --device $dev --backend $bk --tokens 4096 --hidden 2048 \
  --mlp-iters 1 --out-dir "$out"
echo; printf '%s\n' "${summary[@]}"
