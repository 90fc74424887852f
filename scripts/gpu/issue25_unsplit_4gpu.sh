#!/usr/bin/env bash
# Issue 25, unsplit forwards under --enable-tokenweave + tw-comm stress of the bulk / sharded-residual calls.
# 4 GPUs (H100/H200, one rank per GPU), budget 240 s incl. the libtwcomm build (~25 s on a fresh machine):
#  0. build libtwcomm (nvcc, sm_90a; cached by content hash)
#  1. tw-comm robustness of the calls TokenWeave's split halves make (test/gpu/tw_comm_stress_gpus.py), 2 GPUs:
#     a. 20,000 back-to-back fused AllReduce+RMSNorm calls, T=16 x 8192 bf16 on 16 CTAs, cycling p2p_twoshot_bulk and
#        the residual-sharded p2p_twoshot / p2p_twoshot_pipe / p2p_twoshot_bulk / ce, each checked against NCCL fp32
#        + fp32 RMSNorm (sharded: owned residual rows vs the reference, other rows untouched) every 10,000 calls;
#        killed (= hang) after its cap
#     b. compute-sanitizer racecheck, 2 ranks, 4 calls of each of those 5 variants at T=16 x 1024, then a checked
#        call of each
#  2. A/B of a TP4 forward WITHOUT a split (benchmark/tokenweave/bench_layer.py layer mode, Llama-3.3-70B config cut to 4 layers,
#     dummy bf16, T = 1024 and 4096, --min-tokens 1000000 so TokenWeave never splits): `tokenweave` (the server's
#     --enable-tokenweave communicator: unsplit calls on the plain communicator since this change) vs `custom` (the
#     server without --enable-tokenweave: auto = custom all-reduce, NCCL above 8 MiB) vs `tokenweave_oldcomm`
#     (tw-comm for every call: the pre-change unsplit path, bulk kernel off); eager and CUDA-graphed (one graph per
#     variant and T: checks capture of the sequential executor on the composed communicator); two runs, the variant
#     order reversed in the second; medians of CUDA events per run. Expect tokenweave / custom ~= 1.00 in both.
#  3. (if >= 50 s are left) stories260K (trained) TP4 end to end, TokenWeave off/on with CUDA graphs ON (decode
#     graphs captured under TokenWeave), --tokenweave-min-tokens 16 (prefills split): greedy ids on == off
# Tables: $OUT/issue25_unsplit_*.md. Usage (repo root): bash scripts/gpu/issue25_unsplit_4gpu.sh [seconds, default 240]
# DRY_RUN=1 prints each step's command instead of running it (checks the flow on a CPU machine).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-240}"; start=$SECONDS
dry="${DRY_RUN:-0}"
left() { echo $(( budget - (SECONDS - start) )); }
cap() { local want=$1 l; l=$(( $(left) - 2 )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }
out="${OUT:-/tmp/issue25_unsplit}"; mkdir -p "$out"
summary=()
step() { summary+=("$1: $2 ($(( SECONDS - start )) s)"); echo "-- $1: $2"; }
run() {  # run LOG SECONDS CMD...: CMD under timeout, output to LOG; DRY_RUN prints the command (rc 0)
  local log=$1 secs=$2; shift 2
  if [ "$dry" = 1 ]; then echo "DRY: timeout $secs $* > $log"; return 0; fi
  timeout --kill-after=5 "$secs" "$@" > "$log" 2>&1
}
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
ngpu="$(nvidia-smi -L 2>/dev/null | wc -l)"
echo "$ngpu x ${gpu:-no GPU}, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), budget $budget s"
m70=../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct
new_variants=(p2p_twoshot_bulk p2p_twoshot_sharded p2p_twoshot_pipe_sharded p2p_twoshot_bulk_sharded ce_sharded)

echo "== 0. build libtwcomm"
run "$out/issue25_unsplit_build.log" "$(cap 45)" "$PY" -c \
  "from sgl_kernel.tw_comm.build import build_library; print(build_library())"
rc=$?; tail -2 "$out/issue25_unsplit_build.log"; step build "rc=$rc"

echo "== 1a. 20,000 back-to-back calls: bulk + sharded-residual variants, world 2"
s=$(cap 30)
run "$out/issue25_unsplit_stress.log" "$s" "$PY" test/gpu/tw_comm_stress_gpus.py --world 2 --calls 20000 \
  --tokens 16 --hidden 8192 --sms 16 --check-every 10000 --variants "${new_variants[@]}" --timeout $(( s - 6 ))
rc=$?; grep "\[tw-comm stress\]" "$out/issue25_unsplit_stress.log" | tail -3
[ "$rc" -ne 0 ] && tail -5 "$out/issue25_unsplit_stress.log"
{ echo "# tw-comm back-to-back calls, bulk + sharded residual (world 2, $ngpu x $gpu)"; echo
  echo "rc=$rc (0 ok, 1 check failed, 2 hang)"; echo '```'; grep "\[tw-comm stress\]" "$out/issue25_unsplit_stress.log"
  echo '```'; } > "$out/issue25_unsplit_stress.md"
step stress_bulk_sharded "rc=$rc"

echo "== 1b. compute-sanitizer racecheck, 2 ranks, bulk + sharded-residual variants"
if command -v compute-sanitizer >/dev/null || [ "$dry" = 1 ]; then
  s=$(cap 40)
  run "$out/issue25_unsplit_racecheck.log" "$s" compute-sanitizer --tool racecheck --racecheck-report all \
    --error-exitcode 9 --target-processes all "$PY" test/gpu/tw_comm_stress_gpus.py --world 2 --calls 20 --tokens 16 \
    --hidden 1024 --sms 4 --check-every 20 --variants "${new_variants[@]}" --timeout $(( s - 4 ))
  rc=$?
  { echo "# compute-sanitizer racecheck, 2 ranks (20 calls of ${new_variants[*]} + checks)"; echo
    echo "rc=$rc (0: ran and checked, no hazard; 9: sanitizer errors; 1: a check failed; 2: not done in time)"
    echo '```'; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|Race reported|\[tw-comm stress\]" \
      "$out/issue25_unsplit_racecheck.log" | sort | uniq -c | head -20; echo '```'; } > "$out/issue25_unsplit_racecheck.md"
  grep -E "SUMMARY|\[tw-comm stress\]" "$out/issue25_unsplit_racecheck.md" | head -6
  step racecheck "rc=$rc"
else
  step racecheck "not run: compute-sanitizer not on PATH"
fi

echo "== 2. TP4 unsplit forward A/B: tokenweave (no split) vs custom (TokenWeave off) vs tokenweave_oldcomm"
ab() {  # ab TAG VARIANT...: one bench_tokenweave run, variants in the given order
  local tag=$1; shift
  local s; s=$(cap 58)
  mkdir -p "$out/ab_$tag"
  run "$out/issue25_unsplit_ab_$tag.log" "$s" "$PY" benchmark/tokenweave/bench_layer.py --tp 4 --layers 4 \
    --model-path "$m70" --tokens 1024 4096 --variants "$@" --min-tokens 1000000 --iters 7 --warmup 5 --cuda-graph \
    --results-dir "$out/ab_$tag" --timeout $(( s - 4 ))
  local rc=$?
  cp "$out"/ab_"$tag"/*_tokenweave_layer.md "$out/issue25_unsplit_ab_$tag.md" 2>/dev/null \
    || grep "\[partial\]" "$out/issue25_unsplit_ab_$tag.log" > "$out/issue25_unsplit_ab_$tag.md"
  [ "$rc" -ne 0 ] && grep -E "Error|error|Timeout" "$out/issue25_unsplit_ab_$tag.log" | tail -4
  step "ab_$tag ($*)" "rc=$rc"
}
if [ "$ngpu" -ge 4 ] || [ "$dry" = 1 ]; then
  ab order1 tokenweave custom tokenweave_oldcomm
  if [ "$(left)" -ge 40 ] || [ "$dry" = 1 ]; then
    ab order2 tokenweave_oldcomm custom tokenweave
  else
    step ab_order2 "not run ($(left) s left)"
  fi
else
  step ab "not run: needs 4 GPUs, found $ngpu"
fi

echo "== 3. stories260K TP4 greedy ids, TokenWeave off/on, CUDA graphs on"
if [ "$(left)" -ge 50 ] || [ "$dry" = 1 ]; then
  s=$(cap 60)
  run "$out/issue25_unsplit_stories.log" "$s" "$PY" benchmark/tokenweave/bench_e2e.py \
    --model-path ../shared/data/models/stories260K --load-format auto --dtype bfloat16 --tp 4 \
    --num-prompts 8 --input-len 200 --output-len 16 --reps 1 --rounds 1 --min-tokens 16 --chunked-prefill-size 1024 \
    --max-total-tokens 8192 --cuda-graph-max-bs 8 --budget $(( s - 4 )) --out "$out/issue25_unsplit_stories.md"
  rc=$?; [ "$rc" -ne 0 ] && tail -5 "$out/issue25_unsplit_stories.log"
  step stories_greedy_graphs "rc=$rc"
else
  step stories_greedy_graphs "not run ($(left) s left)"
fi

echo "== summary ($ngpu x $gpu, budget $budget s, used $(( SECONDS - start )) s)"
printf '%s\n' "${summary[@]}"
for f in "$out"/issue25_unsplit_ab_order1.md "$out"/issue25_unsplit_ab_order2.md; do
  [ -f "$f" ] && { echo "## $(basename "$f")"; grep -E "^\| meta|^- T=|\[partial\]" "$f"; }
done
[ -f "$out/issue25_unsplit_stories.md" ] && grep -iE "equal|mismatch|^\| (off|on)" "$out/issue25_unsplit_stories.md"
exit 0
