#!/usr/bin/env bash
# Issue 26 at world 4 (one rank per GPU, 4 GPUs), <= 180 s with every JIT/Triton compile. Correctness first:
#   1. test_w4   test/gpu/test_tdist_decomp_w4_gpu.py: the decomposition AG-GEMM / GEMM-RS at world 4 vs torch
#                (even / uneven / empty segments, back-to-back, both per-peer stream schedules "ring" and "all",
#                1 and 3 pieces, receive waits on their own streams (new default) and on the push streams, split
#                pushes followed by a CUDA-graph capture (the order that invalidated the bench's captures), eager +
#                CUDA graph, the Auto* NCCL fallback); the group's own timeout (110 s: the test needed ~110 s on
#                4 x H200 before its inputs were drawn on the GPU) fires before the step's limit, so a slow or hung
#                case is named in the log instead of an empty log;
#   2. bench_w4  benchmark/tdist/bench_kernels.py --world 4, Llama-3.3-70B TP4 shapes, M = 2048 / 8192: the planned
#                decomposition, notes: 1/2/4 pieces, the other schedule, bounded waits, split pushes, receive waits
#                on the push streams (the layout before this fix: A/B of the schedule fix), CUDA-graph replay (=
#                GPU time without host enqueue; failed at every M 8192 row before the join fix), NCCL + cuBLAS again
#                after 'auto'; the auto op; NCCL + cuBLAS, torch symm-mem fused, cuBLAS alone; 'profile': one
#                decomposition call per shape at M 8192 on rank 0, every rank's profiler running before any call
#                starts (host enqueue ms, GPU span, GEMM / copy / overlap / idle ms, copy GB/s);
#   3. status    benchmark/tdist/targets_status.py on the world-4 table (results table only);
#   4. bench_w2  the same at world 2 on GPUs 0-1 (M 8192, o_proj only), only if >= 30 s are left.
# Outputs in $OUT: issue26_w4_bench.md, issue26_w4_status.md, issue26_w2_bench.md, issue26_4gpu_summary.md, logs.
# Usage (repo root): bash scripts/gpu/issue26_4gpu.sh [seconds, default 180]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
export TRITON_DEFAULT_FP_FUSION=1
unset TDIST_CASES
budget="${1:-180}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/issue26_4gpu}"; mkdir -p "$out"
summary=()
step() {  # step NAME SECONDS CMD...: run with a limit (cut to what is left), log, record the exit code
  local name="$1" secs="$2"; shift 2
  (( secs > $(left) - 2 )) && secs=$(( $(left) - 2 ))
  (( secs < 10 )) && { summary+=("- $name: not run (no time left)"); return; }
  echo; echo "== $name (limit ${secs}s, $(left)s left)"
  local t0=$SECONDS
  timeout --kill-after=3 "$secs" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  grep -E "passed|failed|skipped|^\| |Error|problem" "$out/$name.log" | tail -45
  (( rc == 124 || rc == 137 )) && echo "!! $name hit its ${secs}s limit"
  summary+=("- $name: exit $rc in $(( SECONDS - t0 ))s")
}
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
ngpu="$(nvidia-smi -L 2>/dev/null | wc -l)"
echo "$ngpu x $gpu"

TDIST_GPU_TIMEOUT=110 step test_w4 120 "$PY" -m pytest -q -p no:cacheprovider -rA test/gpu/test_tdist_decomp_w4_gpu.py
mkdir -p "$out/w4" "$out/w2"
step bench_w4 46 "$PY" benchmark/tdist/bench_kernels.py --world 4 --tp-shapes 4 --tokens 2048 8192 --a2a-tokens \
  --iters 20 --variants decomp pieces auto graph profile --results-dir "$out/w4" --timeout 42
for f in "$out"/w4/*_tdist.md; do [ -f "$f" ] && mv "$f" "$out/issue26_w4_bench.md"; done
[ -f "$out/issue26_w4_bench.md" ] && "$PY" benchmark/tdist/targets_status.py "$out/issue26_w4_bench.md" \
  "$out/issue26_w4_status.md" > /dev/null 2>&1
if (( $(left) >= 30 )); then
  CUDA_VISIBLE_DEVICES=0,1 step bench_w2 "$(( $(left) - 2 ))" "$PY" benchmark/tdist/bench_kernels.py --world 2 \
    --tp-shapes 4 --tokens 8192 --ops o_proj --a2a-tokens --iters 20 \
    --variants decomp pieces auto graph profile --results-dir "$out/w2" --timeout $(( $(left) - 6 ))
  for f in "$out"/w2/*_tdist.md; do [ -f "$f" ] && mv "$f" "$out/issue26_w2_bench.md"; done
else
  summary+=("- bench_w2: not run (< 30 s left)")
fi
res="$out/issue26_4gpu_summary.md"
{
  echo "# Issue 26 world 4 on $ngpu x $gpu ($(date -u +%Y-%m-%dT%H:%MZ)); \`bash scripts/gpu/issue26_4gpu.sh $budget\`"
  echo "- NVLink multicast off in every process (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1)"
  echo; echo "## world-4 decomposition test"; grep -hE "passed|failed|skipped|Error" "$out/test_w4.log" 2>/dev/null | tail -8
  echo; echo "## bench world 4"; cat "$out/issue26_w4_bench.md" 2>/dev/null || echo "(none; see bench_w4.log)"
  echo; echo "## status world 4"; cat "$out/issue26_w4_status.md" 2>/dev/null || echo "(none)"
  echo; echo "## bench world 2 (GPUs 0-1)"; cat "$out/issue26_w2_bench.md" 2>/dev/null || echo "(none)"
  echo; echo "## steps"; printf '%s\n' "${summary[@]}"
} > "$res"
echo "== summary (budget ${budget} s, used $(( SECONDS - start )) s; $ngpu x $gpu)"; printf '%s\n' "${summary[@]}"
