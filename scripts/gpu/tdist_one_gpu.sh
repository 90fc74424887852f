#!/usr/bin/env bash
# Triton-distributed on ONE GPU (issue 16): the GPU tests (2 and 4 ranks as processes sharing the GPU, the symmetric
# heap mapped through CUDA IPC within the device; every primitive and kernel vs torch; the sequence-parallel executor
# on the fused ops vs the single process), the benchmark's one-GPU smoke, and a compute-sanitizer memcheck of a small
# 2-rank case. Every step runs even when an earlier one fails or hangs (each has a time limit); a summary with each
# step's exit code is printed at the end and written to $OUT/tdist_summary.txt. Logs: $OUT (default /tmp/tdist_gpu_logs).
# The CPU parts (AOT sm_90a compile + PTX checks, interpreter runs, bookkeeping) run in CI: test/unit/test_tdist_*.py.
# Usage (repo root, shared data at ../shared/data): bash scripts/gpu/tdist_one_gpu.sh [seconds, default 560]
# (560 fits one 10-minute command; every limit scales with it, so give 1200 where a command may run longer).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$root/python:$root/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
budget="${1:-560}"; start=$SECONDS
left() { local l=$(( budget - (SECONDS - start) )); (( l < 20 )) && l=20; echo $l; }
out="${OUT:-/tmp/tdist_gpu_logs}"; mkdir -p "$out"
summary=()
step() {  # step NAME SECONDS CMD...: run with a limit, keep the log, record the exit code, never stop the script
  local name="$1" secs="$2"; shift 2
  echo; echo "== $name (limit ${secs}s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$secs" "$@" > "$out/tdist_$name.log" 2>&1
  local rc=$?
  tail -25 "$out/tdist_$name.log"
  if (( rc == 124 || rc == 137 )); then
    echo "!! $name TIMED OUT after ${secs}s (device-side hang or slow time-slicing): see $out/tdist_$name.log"
  fi
  summary+=("$name: exit $rc in $(( SECONDS - t0 ))s")
}

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv 2>&1 | head -3
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" 2>&1
env | grep -E "NVLS|MULTICAST" | sort

# kernels + primitives: one rank group per world size (2, 4) runs every case; a hang names each rank's last progress
step gpu_kernels $(( $(left) * 42 / 100 )) env TDIST_GPU_TIMEOUT=$(( $(left) * 19 / 100 )) \
  python3 -m pytest -v -rA test/gpu/test_tdist_gpu.py -k test_tdist_case -p no:cacheprovider
grep -E "case seconds|pingpong|PASSED|FAILED|ERROR|timed out|raised" "$out/tdist_gpu_kernels.log" | head -40
# the engine path: the sequence-parallel executor on the fused ops (TP 2, 4 sharing the GPU) and the HTTP server
step gpu_engine $(( $(left) * 45 / 100 )) python3 -m pytest -v -rA test/gpu/test_tdist_gpu.py \
  -k "executor or server" -p no:cacheprovider

step bench_smoke $(( $(left) * 55 / 100 )) python3 benchmark/bench_tdist.py --world 2 --share-gpu --tokens 1024 \
  --a2a-tokens 256 --iters 3 --results-dir "$out" --timeout $(( $(left) * 45 / 100 ))

if command -v compute-sanitizer >/dev/null; then
  step memcheck $(( $(left) - 10 )) compute-sanitizer --tool memcheck --target-processes all \
    python3 test/gpu/tdist_sanitizer_case.py
  grep -E "ERROR SUMMARY|Invalid|sanitizer case" "$out/tdist_memcheck.log" | head -10
else
  echo "compute-sanitizer not found: memcheck not run"; summary+=("memcheck: not run (no compute-sanitizer)")
fi

echo; echo "== summary (logs in $out)"
printf '%s\n' "${summary[@]}" | tee "$out/tdist_summary.txt"
