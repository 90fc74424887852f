#!/usr/bin/env bash
# KVDirect transfer layer on one GPU: NIXL VRAM reads/writes between processes (hetero TP, page sizes), the
# CPU transfer tests, and benchmark/disaggregation/bench_kv_transfer.py --device cuda (msg vs per-block vs coalesced; target:
# coalesced >= 3x per-block at 4 KB blocks). Usage (repo root): bash scripts/gpu/kv_transfer.sh
# Needs nixl (pip install 'sglang[pd]' / nixl-cu13, or nixl-cu12 for a CUDA-12 torch). Logs go to $OUT if set.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
out="${OUT:-$(mktemp -d /tmp/kv-transfer.XXXXXX)}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/env.log"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/env.log"
"$PY" -c "from sglang.srt.disaggregation.transfer.base import nixl_available as n; print('nixl', n())" \
  | tee -a "$out/env.log"
rc=0
timeout 300 "$PY" -m pytest -q -x test/gpu/test_kv_transfer_gpu.py 2>&1 | tee "$out/gpu_tests.log" || rc=1
timeout 300 "$PY" -m pytest -q -x test/unit/test_transfer_backends.py test/unit/test_kv_plan.py \
  test/unit/test_transfer_queue.py 2>&1 | tee "$out/cpu_tests.log" || rc=1
timeout 900 "$PY" benchmark/disaggregation/bench_kv_transfer.py --device cuda --max-mb 512 --out-dir "$out" 2>&1 \
  | grep -v "NIXL INFO" | tee "$out/bench_cuda.log" || rc=1
timeout 600 "$PY" benchmark/disaggregation/bench_kv_transfer.py --device cuda --run-pages 16 --max-mb 512 --tag _runs16 \
  --out-dir "$out" 2>&1 | grep -v "NIXL INFO" | tee "$out/bench_cuda_runs16.log" || rc=1
echo "kv_transfer.sh done rc=$rc (logs in $out)"
exit $rc
