#!/usr/bin/env bash
# Triton-distributed on ONE GPU (issue 16): environment report, AOT/PTX check, the GPU tests (2 and 4 ranks as
# processes sharing the GPU, heap mapped through CUDA IPC within the device), a compute-sanitizer memcheck of a small
# 2-rank case, and the benchmark's one-GPU smoke. Every step runs even when an earlier one fails; a summary with each
# step's exit code is printed at the end (and written to $OUT/tdist_summary.txt when OUT is set).
# Usage (repo root): bash scripts/gpu/tdist_one_gpu.sh [seconds, default 1500]
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$root/python:$root/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
budget="${1:-1500}"; start=$SECONDS
left() { local l=$(( budget - (SECONDS - start) )); (( l < 30 )) && l=30; echo $l; }
out="${OUT:-/tmp/tdist_gpu_logs}"; mkdir -p "$out"
declare -a summary
step() {  # step NAME SECONDS CMD...: run, log, record the exit code, never stop the script
  local name="$1" secs="$2"; shift 2
  echo; echo "== $name (limit ${secs}s)"
  local t0=$SECONDS
  timeout --kill-after=20 "$secs" "$@" > "$out/tdist_$name.log" 2>&1
  local rc=$?
  tail -40 "$out/tdist_$name.log"
  (( rc == 124 || rc == 137 )) && echo "!! $name TIMED OUT after ${secs}s (a device-side hang?): see $out/tdist_$name.log"
  summary+=("$name: exit $rc in $(( SECONDS - t0 ))s")
}

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv 2>&1 | head -5
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" 2>&1
env | grep -E "NVLS|MULTICAST" | sort

step aot_ptx 300 python3 -m pytest -q test/unit/test_tdist_aot.py -p no:cacheprovider
step heap_unit 120 python3 -m pytest -q test/unit/test_tdist_heap.py -p no:cacheprovider
# the GPU tests: one group per world size (2, 4), each rank runs every case; per-case failures and hangs are listed
step gpu_tests $(( $(left) * 55 / 100 )) env TDIST_GPU_TIMEOUT=$(( $(left) * 25 / 100 )) \
  python3 -m pytest -q -rA test/gpu/test_tdist_gpu.py -p no:cacheprovider
grep -E "case seconds|PASSED|FAILED|timed out|raised" "$out/tdist_gpu_tests.log" | head -60

if command -v compute-sanitizer >/dev/null; then
  step memcheck $(( $(left) * 30 / 100 )) compute-sanitizer --tool memcheck --target-processes all \
    python3 test/gpu/tdist_sanitizer_case.py
  grep -E "ERROR SUMMARY|Invalid|sanitizer case" "$out/tdist_memcheck.log" | head -10
else
  echo "compute-sanitizer not found: memcheck not run"; summary+=("memcheck: not run (no compute-sanitizer)")
fi

step bench_smoke $(( $(left) - 20 )) python3 benchmark/bench_tdist.py --world 2 --share-gpu --tokens 1024 4096 \
  --a2a-tokens 128 1024 --iters 5 --results-dir "$out" --timeout $(( $(left) - 60 ))

echo; echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$out/tdist_summary.txt"
