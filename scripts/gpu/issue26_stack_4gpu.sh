#!/usr/bin/env bash
# Issue 26 on 4 GPUs, <= 160 s with every compile: the two items left open.
#   1. sanitizer  compute-sanitizer on the 2-rank cases of test/gpu/tdist_sanitizer_case.py, mode 'all' (one group:
#                 the decomposition AG-GEMM / GEMM-RS in 2 and 3 pieces with uneven rows and back-to-back calls,
#                 the one-copy all-to-all with dispatch / combine / a refused count, then the Triton kernels: AG-GEMM
#                 SM and CE producers, GEMM-RS, all-to-all): memcheck on GPUs 0,1 and racecheck on GPUs 2,3 at the
#                 same time (two independent 2-rank groups; racecheck checks shared-memory hazards inside kernels,
#                 memcheck every device access incl. the peers' IPC-mapped heaps);
#   2. stack      benchmark/tdist/bench_layer_stack.py: Llama-3.3-70B-Instruct config cut to 4 decoder layers, dummy bf16
#                 weights, TP 4 (one rank per GPU), prefill of one request of T = 4096 and 8192 tokens through the
#                 executor a worker gets with --enable-tdist-overlap ('tdist', built-in calibration table of the GPU
#                 model) and without ('off'), plus 'sp_nccl' (the flag's layout on NCCL + cuBLAS: the reduction-order
#                 noise floor), on the same weights, order alternating per round, medians of CUDA events (slowest
#                 rank); final hidden states and greedy tokens at 128 positions compared before warm-up and after
#                 timing.
# Outputs in $OUT: issue26_sanitizer.md, issue26_stack.md (+ .json per rank), issue26_stack_summary.md, logs.
# Usage (repo root): bash scripts/gpu/issue26_stack_4gpu.sh [seconds, default 160]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
export TRITON_DEFAULT_FP_FUSION=1
unset TDIST_CASES
budget="${1:-160}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/issue26_stack}"; mkdir -p "$out"
summary=()
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
ngpu="$(nvidia-smi -L 2>/dev/null | wc -l)"
echo "$ngpu x $gpu, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%FT%TZ)"

# ---- 1. sanitizers (two 2-rank groups at once; GNU timeout leads its own process group: leftovers are killed) ----
san_secs=$(( $(left) < 70 ? $(left) - 5 : 65 ))
sanitize() {  # sanitize TOOL GPUS: in the background; $! is the timeout process (leader of its process group)
  CUDA_VISIBLE_DEVICES="$2" timeout --kill-after=3 "$san_secs" compute-sanitizer --tool "$1" \
    --target-processes all "$PY" test/gpu/tdist_sanitizer_case.py all > "$out/issue26_$1.log" 2>&1 &
}
if command -v compute-sanitizer >/dev/null; then
  echo; echo "== sanitizer (memcheck on GPUs 0,1; racecheck on GPUs 2,3; limit ${san_secs}s)"
  t0=$SECONDS
  sanitize memcheck 0,1; pm=$!
  sanitize racecheck 2,3; pr=$!
  wait "$pm"; rm_=$?
  wait "$pr"; rr_=$?
  for g in "$pm" "$pr"; do  # leftovers of either group must not hold GPUs into the stack step
    kill -KILL -- "-$g" 2>/dev/null && echo "(killed leftover processes of sanitizer group $g)"
  done
  {
    echo "# Issue 26: compute-sanitizer on the 2-rank cases ($(date -u +%FT%TZ), $ngpu x $gpu)"
    echo
    echo "- command: \`compute-sanitizer --tool TOOL --target-processes all python3 test/gpu/tdist_sanitizer_case.py all\`"
    echo "  (memcheck: CUDA_VISIBLE_DEVICES=0,1; racecheck: CUDA_VISIBLE_DEVICES=2,3; limit ${san_secs}s each, concurrent)"
    echo
    echo "| tool | exit | parts (rank: result) | sanitizer summaries (count x line) |"
    echo "|---|---|---|---|"
    for t in memcheck racecheck; do
      rc=$rm_; [ "$t" = racecheck ] && rc=$rr_
      parts="$(grep -E '^sanitizer (part|case)' "$out/issue26_$t.log" | sed 's/sanitizer //' | tr '\n' ';')"
      sums="$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/issue26_$t.log" | sed 's/=* *//' | sort | uniq -c \
              | tr -s ' ' | tr '\n' ';')"
      echo "| $t | $rc$( ((rc == 124 || rc == 137)) && echo ' (time limit)') | ${parts:-none} | ${sums:-none} |"
    done
  } > "$out/issue26_sanitizer.md"
  cat "$out/issue26_sanitizer.md"
  summary+=("- sanitizer: memcheck exit $rm_, racecheck exit $rr_, $(( SECONDS - t0 ))s")
else
  summary+=("- sanitizer: not run (no compute-sanitizer on PATH)")
fi

# ---- 2. the layer stack at world 4 ----
secs=$(( $(left) - 3 ))
if (( ngpu >= 4 && secs >= 30 )); then
  echo; echo "== stack (world 4, limit ${secs}s)"
  t0=$SECONDS
  mkdir -p "$out/stack"
  timeout --kill-after=3 "$secs" "$PY" benchmark/tdist/bench_layer_stack.py \
    --model-path ../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct --tp 4 --layers 4 --tokens 4096 8192 \
    --warmup 10 --iters 20 --results-dir "$out/stack" --timeout $(( secs - 5 )) > "$out/issue26_stack.log" 2>&1 &
  ps_=$!
  wait "$ps_"; rc=$?
  kill -KILL -- "-$ps_" 2>/dev/null && echo "(killed leftover processes of the stack step)"
  for f in "$out"/stack/*_tdist_stack.md; do [ -f "$f" ] && cp "$f" "$out/issue26_stack.md"; done
  for f in "$out"/stack/*_tdist_stack.json; do [ -f "$f" ] && cp "$f" "$out/issue26_stack.json"; done
  grep -E "^\[partial\]|Error|error|problem" "$out/issue26_stack.log" | cut -c1-400 | tail -12
  summary+=("- stack: exit $rc in $(( SECONDS - t0 ))s$( ((rc == 124 || rc == 137)) && echo ' (time limit)')")
else
  summary+=("- stack: not run ($ngpu GPUs, ${secs}s left)")
fi

{
  echo "# Issue 26: sanitizers on 2 ranks, --enable-tdist-overlap layer stack at TP 4"
  echo
  echo "- date: $(date -u +%FT%TZ); hardware: $ngpu x $gpu; commit $(git rev-parse --short HEAD 2>/dev/null)"
  echo "- command: bash scripts/gpu/issue26_stack_4gpu.sh $budget (NVLink multicast off in every process)"
  echo; echo "## steps"; printf '%s\n' "${summary[@]}"
  echo; echo "## sanitizers"; cat "$out/issue26_sanitizer.md" 2>/dev/null | grep -E "^\|" || echo "(none)"
  echo; echo "## stack"
  grep -E "^\||^- (T=|timing|outputs|model)|^tdist op" "$out/issue26_stack.md" 2>/dev/null \
    || { echo "no table; partial lines:"; grep -E "^\[partial\]" "$out/issue26_stack.log" 2>/dev/null | cut -c1-400; }
} > "$out/issue26_stack_summary.md"
echo; cat "$out/issue26_stack_summary.md"
