#!/usr/bin/env bash
# PD push mode's layerwise KV writes (issue 13) on ONE GPU:
#  1. the @gpu unit test: per-layer CUDA events order each layer's WRITE behind its KV store, the forward's host
#     thread never blocks per layer (test/unit/test_pd_layerwise_push.py);
#  2. the end-to-end layerwise / after-the-fact push test on cuda (prefill and decode servers on the same GPU,
#     --mem-fraction-static 0.2) when nixl imports (the fake backend copies host memory only).
# Usage (repo root, shared data at ../shared/data): bash scripts/gpu/pd_push_layerwise.sh [seconds, default 300]
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$root/python:$root/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
. "$root/scripts/gpu/lib_budget.sh"; budget_start "${1:-300}"  # left: seconds of it left
out="${OUT:-/tmp}"
echo "== layerwise push: CUDA event ordering (unit, @gpu)"
timeout 120 python3 -m pytest -q -x test/unit/test_pd_layerwise_push.py -p no:cacheprovider 2>&1 \
  | tee "$out/pd_push_layerwise_unit.log" | tail -15
if python3 -c "from sglang.srt.disaggregation.transfer.base import nixl_available as a; import sys; sys.exit(0 if a()[0] else 1)"; then
  echo "== layerwise push end to end on cuda (nixl)"
  SGLANG_PD_TEST_DEVICE=cuda SGLANG_PD_TEST_BACKEND=nixl timeout $(( $(left) - 5 )) \
    python3 -m pytest -q -x test/integration/test_pd_push_layerwise.py -p no:cacheprovider 2>&1 \
    | tee "$out/pd_push_layerwise_e2e.log" | tail -20
else
  echo "== SKIP end to end on cuda: nixl does not import (pip install nixl-cu12 or nixl-cu13)"
fi
echo "== bench_push_layerwise (layerwise vs after the forward, synthetic staged model)"
bk=fake; dev=cpu
if python3 -c "from sglang.srt.disaggregation.transfer.base import nixl_available as a; import sys; sys.exit(0 if a()[0] else 1)"; then
  bk=nixl; dev=cuda
fi
for cfg in "--tokens 2048 --hidden 1024 --mlp-iters 1" "--tokens 4096 --hidden 2048 --mlp-iters 1"; do
  timeout 120 python3 benchmark/disaggregation/bench_push_layerwise.py --device $dev --backend $bk $cfg --out-dir "$out" 2>&1 | tail -12
done
