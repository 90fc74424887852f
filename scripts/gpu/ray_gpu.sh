#!/usr/bin/env bash
# --use-ray on one GPU: a one-node Ray cluster; TP1 and TP2 (ranks sharing the GPU) through Ray must give the
# greedy tokens of the same server without Ray, with the GPU id Ray assigned reported. Needs the ray extra
# (pip install "./python[ray]", done by scripts/install.sh). Usage (repo root): bash scripts/gpu/ray_gpu.sh
# Logs go to $OUT when set (device runner).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
export RAY_AUTH_MODE=disabled
"$PY" -c "import ray" 2>/dev/null || "$PY" -m pip install -q "ray[default]>=2.40"
nvidia-smi --query-gpu=name,memory.total --format=csv || true
log="${OUT:-/tmp}/ray_gpu.log"
timeout 560 "$PY" -m pytest -x -q -p no:cacheprovider test/gpu/test_ray_gpu.py 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
cp /tmp/sglang-test-server-*.log "${OUT:-/tmp}/" 2>/dev/null || true
exit "$rc"
