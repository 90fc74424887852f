#!/usr/bin/env bash
# Issue 26, round 3 on 2 GPUs (one rank per GPU), <= 150 s wall time with compilation. Correctness first:
#   1. decomp    test/gpu/test_tdist_decomp_gpu.py: decomposition AG-GEMM / GEMM-RS vs torch (planned and explicit
#                pieces, uneven/empty segments, back-to-back, CUDA graphs), the Auto* NCCL fallback, the one-copy
#                all-to-all (dispatch + combine, 50 rounds of random counts, 32 CTAs/peer default), the SM ops with
#                cached metadata, 'bounded' (decomposition with bounded Triton wait kernels, eager + graph) and
#                'deadpeer' (rank 1 never joins: rank 0's bounded wait must raise TdistWaitError in < 10 s, no hang);
#   2. bench     benchmark/tdist/bench_kernels.py --world 2, Llama-3.3-70B TP4 shapes at M = 2048 / 8192: decomposition
#                (planned pieces; 'pieces': 1/2/4 pieces, bulk, bounded waits in the notes), 'auto' (AutoAgGemm /
#                AutoGemmRs with the table calibrated on the row's own timings: decomposition, NCCL + cuBLAS or
#                torch's fused symm-mem op), NCCL + cuBLAS, torch symm-mem fused, cuBLAS alone; all-to-all 1024 x
#                7168 vs NCCL all_to_all_single at 16/32/64 CTAs per peer, and as CUDA graphs ('graph');
#   3. status    benchmark/tdist/targets_status.py: issue26_status.md, one line per target (met / not met);
#   4. memcheck  compute-sanitizer memcheck on the 2-rank one-copy all-to-all case, if >= 25 s are left.
# Outputs in $OUT: issue26_summary.md, issue26_bench.md, issue26_status.md, one log per step.
# Usage (repo root): bash scripts/gpu/issue26_2gpu.sh [seconds, default 150]
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
if [ -f scripts/gpu/device_preamble.sh ]; then source scripts/gpu/device_preamble.sh; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$root/python:$root/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET TDIST_CASES
budget="${1:-150}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/issue26_out}"; mkdir -p "$out"
summary=()
step() {  # step NAME SECONDS CMD...: run with a limit, keep the log, record the exit code, never stop the script
  local name="$1" secs="$2"; shift 2
  (( secs > $(left) - 2 )) && secs=$(( $(left) - 2 ))
  (( secs < 10 )) && { summary+=("- $name: not run (no time left)"); return; }
  echo; echo "== $name (limit ${secs}s, $(left)s left)"
  local t0=$SECONDS
  timeout --kill-after=5 "$secs" "$@" > "$out/issue26_$name.log" 2>&1
  local rc=$?
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|^\| |Error|ERROR SUMMARY|sanitizer case|\[partial\]" "$out/issue26_$name.log" | tail -30
  (( rc == 124 || rc == 137 )) && echo "!! $name hit its ${secs}s limit"
  summary+=("- $name: exit $rc in $(( SECONDS - t0 ))s")
}

{
  echo "# issue 26 round 3 ($(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -2
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" 2>&1
  env | grep -E "NVLS|MULTICAST" | sort
} | tee "$out/issue26_summary.md"

step decomp 55 env TDIST_GPU_TIMEOUT=50 python3 -m pytest -v -rA -p no:cacheprovider test/gpu/test_tdist_decomp_gpu.py

step bench 70 python3 benchmark/tdist/bench_kernels.py --world 2 --tp-shapes 4 --tokens 2048 8192 \
  --a2a-tokens 1024 --a2a-hidden 7168 --iters 20 --variants decomp pieces auto graph --results-dir "$out" --timeout 65
for f in "$out"/*_tdist.md; do [ -f "$f" ] && mv "$f" "$out/issue26_bench.md"; done
if [ -f "$out/issue26_bench.md" ]; then
  python3 benchmark/tdist/targets_status.py "$out/issue26_bench.md" "$out/issue26_status.md" > /dev/null 2>&1 \
    || summary+=("- status: benchmark/tdist/targets_status.py failed")
fi

if command -v compute-sanitizer >/dev/null && (( $(left) >= 25 )); then
  step memcheck $(( $(left) - 3 )) compute-sanitizer --tool memcheck --target-processes all \
    python3 test/gpu/tdist_sanitizer_case.py a2a
else
  summary+=("- memcheck: not run (no compute-sanitizer or $(left)s left < 25s)")
fi

{
  echo; echo "## steps"; printf '%s\n' "${summary[@]}"
  echo; echo "## test results"
  grep -hE "(PASSED|FAILED|SKIPPED|ERROR) *(\[|$)|^(FAILED|ERROR) " "$out"/issue26_decomp.log 2>/dev/null \
    | sed 's/^/    /' | head -30
  [ -f "$out/issue26_memcheck.log" ] && echo "    memcheck: $(grep -E 'ERROR SUMMARY|sanitizer case' \
      "$out/issue26_memcheck.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
  echo; echo "## status vs targets (issue26_status.md)"
  cat "$out/issue26_status.md" 2>/dev/null || echo "no status (see issue26_bench.log)"
  echo; echo "## bench (issue26_bench.md)"
  grep -E "^\| |^calibration|^- (date|hardware|command)" "$out/issue26_bench.md" 2>/dev/null || echo "no table (see issue26_bench.log)"
} | tee -a "$out/issue26_summary.md"
