#!/usr/bin/env bash
# Issue 9 on one GPU: --watchdog-timeout with two TP ranks sharing the GPU (--tp-ranks-share-gpu): SIGSTOP on
# rank 1 must give the in-flight stream a 503 error event + [DONE], /health 503 and a non-zero exit; the
# rendezvous store must listen on 127.0.0.1 only. Then the CPU-only request-limit tests (they need no GPU but
# check the same code with CUDA torch installed).
# Usage (repo root): bash scripts/gpu/issue9_watchdog.sh   (logs under $OUT when set)
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
logdir="${OUT:-$(mktemp -d /tmp/issue9.XXXXXX)}"
mkdir -p "$logdir"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi failed"
rc=0
SGLANG_TEST_DEVICE=cuda timeout 300 "$PY" -m pytest -x -q -rs test/integration/test_watchdog_tp_cpu.py \
    2>&1 | tee "$logdir/watchdog_gpu.log" || rc=1
timeout 240 "$PY" -m pytest -x -q test/integration/test_request_limits.py test/unit/test_request_limit_helpers.py \
    test/unit/test_new_user_errors.py 2>&1 | tee "$logdir/limits.log" || rc=1
cp /tmp/sglang-test-server-*.log "$logdir/" 2>/dev/null || true
echo "issue9 GPU script: rc=$rc (logs in $logdir)"
exit $rc
