#!/usr/bin/env bash
# Issue 25 item 2 on a 4-GPU machine (one rank per GPU), <= 70 s with the nvcc build: the pipelined two-shot
# (p2p_twoshot_pipe) and the calibrated crossover table of tw-comm's fused AllReduce + RMSNorm.
#   1. build libtwcomm (nvcc, sm_90a)
#   2. GPU correctness at world 4 (quick) of the pipelined two-shot (fp32 reference, NaN-poisoned outputs, full and
#      sharded residual, grids 1..128, several chunks per block, CUDA-graph replay, 600 back-to-back calls mixed
#      with the old two-shot, bit-identical ranks), with Lamport one-shot checks in between (its push now spreads
#      over a grid that may exceed T; the full Lamport test is test_tw_comm_lamport_gpu)
#   3. benchmark/comm/bench_allreduce_rmsnorm.py at world 4 then 2: NCCL + fused norm, NCCL symmetric, torch symm-mem,
#      every tw-comm variant, SM sweep at 16/32 CTAs, --calibrate (writes the crossover table)
# At 70 s the world-2 half of step 3 may be cut (world 4 runs first and is written on its own); 95 s runs all.
# Output: $OUT/issue25_ar_summary.md (every table), $OUT/issue25_ar_bench.md, $OUT/tw_comm_crossovers.json (commit it
# to python/sglang/srt/distributed/), one log per step. Usage: bash scripts/gpu/issue25_ar_4gpu.sh [budget s]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-70}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/issue25_ar}"; mkdir -p "$out"
summary=()
step() {  # step NAME SECONDS CMD...: run with a limit (cut to what is left), log, record the exit code
  local name="$1" secs="$2"; shift 2
  (( secs > $(left) - 2 )) && secs=$(( $(left) - 2 ))
  (( secs < 5 )) && { summary+=("- $name: not run (no time left)"); return; }
  echo; echo "== $name (limit ${secs}s, $(left)s left)"
  local t0=$SECONDS
  timeout --kill-after=3 "$secs" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  grep -E "passed|failed|skipped|Error|\[tw-comm gpu\]|done:" "$out/$name.log" | tail -12
  (( rc == 124 || rc == 137 )) && echo "!! $name hit its ${secs}s limit"
  summary+=("- $name: exit $rc in $(( SECONDS - t0 ))s")
}
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
ngpu="$(nvidia-smi -L 2>/dev/null | wc -l)"
echo "$ngpu x $gpu"

step build 40 "$PY" -c "from sgl_kernel.tw_comm.build import build_library; print(build_library())"
TW_COMM_QUICK=1 step pipe_test_w4 30 "$PY" -m pytest -q -p no:cacheprovider \
  "test/gpu/test_tw_comm_gpu.py::test_tw_comm_pipe_gpu[4]"
mkdir -p "$out/bench"
step bench_w4_w2 "$(left)" "$PY" benchmark/comm/bench_allreduce_rmsnorm.py --worlds 4,2 --lamport --no-ce \
  --tokens 1,32,128,1024,8192 --sweep-sms 16,32 --sweep-min-tokens 1024 --calibrate \
  --calls-per-graph 3 --replays 3 --out "$out/bench" --table "$out/tw_comm_crossovers.json" --tag _issue25

for f in "$out"/bench/tw_comm_allreduce_rmsnorm_*_issue25.md; do [ -f "$f" ] && cp "$f" "$out/issue25_ar_bench.md"; done
res="$out/issue25_ar_summary.md"
{
  echo "# issue 25 item 2 (pipelined two-shot, calibrated crossovers) on $ngpu x $gpu ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo "- command: \`bash scripts/gpu/issue25_ar_4gpu.sh $budget\`; NVLink multicast off in every process"
  echo; echo "## pipe correctness (world 4, quick)"
  grep -hE "passed|failed|Error|\[tw-comm gpu\]" "$out/pipe_test_w4.log" 2>/dev/null | tail -8
  echo; echo "## benchmark (worlds 4, 2)"
  cat "$out/issue25_ar_bench.md" 2>/dev/null || echo "(none; see bench_w4_w2.log)"
  echo; echo "## crossover table"; cat "$out/tw_comm_crossovers.json" 2>/dev/null | tr -d ' \n' | head -c 3000; echo
  echo; echo "## steps"; printf '%s\n' "${summary[@]}"
} > "$res"
echo "== summary (budget ${budget} s, used $(( SECONDS - start )) s; $ngpu x $gpu)"; printf '%s\n' "${summary[@]}"
grep -E "^\| [24] \|" "$out/issue25_ar_bench.md" 2>/dev/null | head -40
