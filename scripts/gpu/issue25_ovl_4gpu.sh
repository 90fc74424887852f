#!/usr/bin/env bash
# Issue 25: TokenWeave overlap. A/B of the split planner at TP4 (4 GPUs, one rank per GPU); budget 300 s including the
# libtwcomm build (~25 s).
# Diagnosis (benchmark/tokenweave/overlap_timeline.py over the 07:02 profile, docs/tokenweave.md): with the GEMMs capped to
# 116 SMs, the old planner cut T=4096 into 384 + 3712 tokens (0 extra waves). The 3712-token split's AllReduce took
# 500-660 us. Only the 384-token split's compute (~100 us attention, ~340 us MLP) could hide it, so the compute
# stream waited ~0.8 ms per layer. The new planner keeps the cut within [3/8, 5/8] of T (2048 + 2048 at 4096) and
# gives the larger part to the prefix.
# Selective carveout (tokenweave_selcarve, TokenWeaveConfig.carveout_scope="overlap"): only the GEMMs that run beside
# the other split's AllReduce in the executor's schedule (sglang.srt.tokenweave.overlap: each split's QKV and gate/up
# projections) are capped to num_sms - carveout; O / down projections and the logits run on every SM. A/B against
# tokenweave (every GEMM capped) in both orders; its timelines show the GEMM kernel sum (10.3 ms capped vs 9.4 nocomm).
#  1. build libtwcomm (nvcc, sm_90a; cached by content hash)
#  2. scripts/gpu/issue25_tw_4gpu.sh with TW_EXTRA_VARIANTS="tokenweave_oldsplit tokenweave_selcarve". It runs
#     benchmark/tokenweave/bench_layer.py on the Llama-3.3-70B config cut to 4 layers, TP4, dummy bf16, T = 1024 2048 4096 8192.
#     Variants: nccl nccl_symm nocomm tokenweave (new planner) tokenweave_oldsplit (old planner)
#     tokenweave_selcarve (new planner, selective carveout). Eager and CUDA-graphed. The correctness
#     section compares each variant's eager logits with nccl's. --overlap-tokens 1024 4096 profiles one eager
#     forward per variant and also one graph replay per variant (rows "(graph replay)"), with timeline CSVs for
#     each TokenWeave variant (1K: where is the 1.26 ms between TokenWeave and nocomm graphed?).
#  3. the same graphed A/B in the reverse order (tokenweave_selcarve and tokenweave_oldsplit before tokenweave; nccl
#     again as the same-run baseline). Order effects show as a difference from step 2. (split_nocomm, the split
#     forward with no collectives, was dropped from this step to make room for tokenweave_selcarve.)
#  4. the new planner with --comm-sms 8 (8 comm CTAs and an 8-SM GEMM carveout instead of 16), against nccl.
#     The carveout makes the split forward's GEMMs ~10% slower (GEMM sum 10.3 vs 9.4 ms for nocomm at 4K).
#  5. benchmark/tokenweave/overlap_timeline.py on every timeline CSV: busy time, overlap, and compute-stream gaps by cause
#     (wait-comm = the compute stream waited for a split's AllReduce).
#  6. (time left; usually none since step 2 grew by the selcarve variant) the TP2 executor test with the sharded residual, one rank per GPU, vs the fp32 reference.
# Tables: $OUT/issue25_ovl.md (steps 2-5). Usage (repo root): bash scripts/gpu/issue25_ovl_4gpu.sh [seconds, default 300]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-300}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
cap() { local want=$1 l; l=$(( $(left) - 2 )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }
out="${OUT:-/tmp/issue25_ovl}"; mkdir -p "$out"
result="$out/issue25_ovl.md"
m70=../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct
summary=()
step() { summary+=("$1: $2 ($(( SECONDS - start )) s)"); echo "-- $1: $2"; }

echo "== 1+2. build libtwcomm; A/B new vs old split planner vs selective carveout (plus nccl nccl_symm nocomm), eager + graph, profile at 1024 and 4096"
OUT="$out" TW_EXTRA_VARIANTS="tokenweave_oldsplit tokenweave_selcarve" TW_RESULT=issue25_ovl.md TW_SKIP_TP2_TEST=1 \
  TW_BENCH_S=135 TW_OVERLAP_TOKENS="1024 4096" \
  bash "$(dirname "$0")/issue25_tw_4gpu.sh" "$(cap 185)" > "$out/issue25_ovl_step2.log" 2>&1
rc=$?; step ab_new_first "rc=$rc"; grep -E "^-- " "$out/issue25_ovl_step2.log"

run_bench() {  # $1 name, $2 seconds, rest: benchmark/tokenweave/bench_layer.py arguments
  local name=$1 secs; secs=$(cap "$2"); shift 2
  mkdir -p "$out/$name"
  timeout --kill-after=5 "$secs" "$PY" benchmark/tokenweave/bench_layer.py --tp 4 --layers 4 --model-path "$m70" \
    --tokens 1024 2048 4096 8192 --iters 5 --warmup 5 --cuda-graph --results-dir "$out/$name" \
    --profile-dir "$out/$name" --timeout $(( secs - 4 )) "$@" > "$out/issue25_ovl_$name.log" 2>&1
  local rc=$?
  { echo; echo "# $name (benchmark/tokenweave/bench_layer.py $*)"; echo
    sed -n '/^## CUDA graph/,/^- replay/p' "$out/$name"/*_tokenweave_layer.md 2>/dev/null \
      || grep "\[partial\]" "$out/issue25_ovl_$name.log"; } >> "$result"
  step "$name" "rc=$rc"
}

echo "== 3. reverse order: tokenweave_selcarve and tokenweave_oldsplit before tokenweave, graphed"
[ "$(left)" -gt 60 ] && run_bench reverse 72 --variants nccl tokenweave_selcarve tokenweave_oldsplit tokenweave

echo "== 4. new planner, 8 comm SMs / 8-SM carveout, vs nccl, graphed"
[ "$(left)" -gt 28 ] && run_bench sms8 33 --variants nccl tokenweave --comm-sms 8

echo "== 5. timelines (rank 0, T=4096 and 1024): busy, overlap, compute-stream gaps by cause"
{ echo; echo "# timelines (benchmark/tokenweave/overlap_timeline.py, rank 0, T=4096 and 1024)"; echo; echo '```'
  for f in "$out"/layer/tokenweave_graph_timeline_*_T4096.csv "$out"/layer/tokenweave_timeline_*_T4096.csv \
      "$out"/layer/tokenweave_graph_timeline_*_T1024.csv; do
    [ -e "$f" ] && timeout 30 "$PY" benchmark/tokenweave/overlap_timeline.py "$f" --top 8 2>&1 \
      | grep -v "^  [0-9.]* | [0-9.]* | [0-9.]* | 1.00 |"  # fully overlapped comm kernels: not listed
  done; echo '```'; } >> "$result"
step timelines "done"

echo "== 6. TokenWeave executor TP2 (sharded residual), one rank per GPU, vs fp32 reference (if time is left)"
if [ "$(left)" -gt 55 ]; then
  timeout --kill-after=5 "$(cap 55)" "$PY" -m pytest -q -x \
    "test/gpu/test_tokenweave_gpu.py::test_tokenweave_tp2_one_rank_per_gpu_sharded_residual[llama_bias_untied]" \
    -p no:cacheprovider > "$out/issue25_ovl_gpu_test.log" 2>&1
  rc=$?; tail -2 "$out/issue25_ovl_gpu_test.log"; step tp2_gpu_test "rc=$rc"
else
  step tp2_gpu_test "not run (no time left)"
fi

echo "== summary (budget $budget s, used $(( SECONDS - start )) s)"
printf '%s\n' "${summary[@]}"
grep -E "^\| meta|^- T=|^# |^span|wait-comm|^## (CUDA|comm)|graph replay" "$result" 2>/dev/null | cut -c1-240 | head -60
