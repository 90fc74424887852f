#!/usr/bin/env bash
# Issue 3 correctness on one GPU: Triton backend + fused ops vs torch_native (every architecture), CUDA graphs
# vs eager, greedy GPU vs CPU on stories260K, then the Triton kernel tests and the dummy Llama-3.1-8B server.
# Usage (repo root): bash scripts/gpu/issue3_correctness.sh [total seconds, default 560]
# Each pytest run gets a share of the time left (so one hang cannot eat the rest); on a failure the script
# prints the server logs and environment facts. When $OUT is set (device runner) the logs are copied there.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$root/python:$root/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
budget="${1:-560}"
logdir="$(mktemp -d /tmp/issue3-correctness.XXXXXX)"
PY="${PYTHON:-python3}"

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || echo "nvidia-smi failed"
"$PY" - <<'EOF' || echo "ENVIRONMENT CHECK FAILED (see above)"
import importlib, sys
print("python", sys.version.split()[0])
for m in ("torch", "triton", "transformers", "fastapi", "uvicorn", "zmq", "msgspec", "requests", "psutil",
          "pytest", "xgrammar"):
    try:
        mod = importlib.import_module(m)
        print(f"  {m} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"  {m} MISSING ({type(e).__name__}: {e})")
import torch
print("cuda available", torch.cuda.is_available(), "torch cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
import sglang, sgl_kernel
from sglang.srt.server_args import ServerArgs
print("sglang", sglang.__file__, "| sgl_kernel", sgl_kernel.__file__)
print("default attention backend on cuda:", ServerArgs(device="cuda").resolved_attention_backend)
EOF
if [[ -d "$root/../shared/data" ]]; then
  echo "shared data: $(cd "$root/../shared/data" && pwd) ($(ls "$root/../shared/data/models" 2>/dev/null | tr '\n' ' '))"
else
  echo "WARNING: $root/../shared/data is absent: the stories260K and Llama-8B tests will be SKIPPED"
fi

rcs=()
names=()
run_step() {  # name, max seconds, pytest args...
  local name="$1" max="$2"
  shift 2
  local left=$(( budget - SECONDS - 5 ))
  local t=$(( max < left ? max : left ))
  if (( t < 30 )); then
    echo "== $name: SKIPPED (only ${left}s of the ${budget}s budget left)"
    names+=("$name"); rcs+=(124)
    return
  fi
  echo "== $name (timeout ${t}s, started at ${SECONDS}s)"
  local before
  before="$(ls /tmp/sglang-test-server-*.log 2>/dev/null | sort)"
  # own process group, so a timeout also ends the servers the tests started (they would hold GPU memory)
  setsid "$PY" -m pytest -p no:cacheprovider -v -s -rfEs --tb=long --durations=15 -m gpu "$@" \
    > >(tee "$logdir/$name.log") 2>&1 &
  local pid=$!
  local marker="$logdir/$name.timed_out"
  ( sleep "$t"; touch "$marker"; echo "== $name: time limit ${t}s reached, stopping it" >&2
    kill -TERM -- "-$pid" 2>/dev/null; sleep 15; kill -KILL -- "-$pid" 2>/dev/null ) &
  local watchdog=$!
  wait "$pid"
  local rc=$?
  [[ -e "$marker" ]] && rc=124
  kill "$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
  sleep 1
  names+=("$name"); rcs+=("$rc")
  echo "== $name: rc=$rc (at ${SECONDS}s)"
  if (( rc != 0 )); then
    (( rc == 124 )) && echo "== $name TIMED OUT after ${t}s"
    for f in $(ls /tmp/sglang-test-server-*.log 2>/dev/null | sort); do
      if ! grep -qxF "$f" <<<"$before"; then
        echo "---- server log $f (last 80 lines)"
        tail -n 80 "$f"
        cp "$f" "$logdir/" 2>/dev/null
      fi
    done
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv 2>/dev/null
    ps -eo pid,etimes,rss,cmd | grep -E "sglang|pytest" | grep -v grep | head -20
  fi
}

run_step gpu_correctness 330 test/gpu/test_gpu_correctness.py
run_step triton_kernels 150 test/gpu/test_triton_kernels_gpu.py
run_step dummy_llama8b 240 test/gpu/test_server_dummy_llama8b.py

if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT/issue3_correctness"
  cp "$logdir"/* "$OUT/issue3_correctness/" 2>/dev/null || true
fi
echo "== summary (total ${SECONDS}s; logs in $logdir)"
status=0
for i in "${!names[@]}"; do
  echo "  ${names[$i]}: rc=${rcs[$i]}"
  (( rcs[i] != 0 )) && status=1
done
exit $status
