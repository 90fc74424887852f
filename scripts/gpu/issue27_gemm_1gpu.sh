#!/usr/bin/env bash
# Issue 27 item 2, decode-GEMM autotune, on ONE H100 or H200 (budget ISSUE27_GEMM_BUDGET_S, default 150 s wall,
# Triton compiles included; the tests compile the candidate kernels first, later steps hit Triton's disk cache):
#   1. GPU tests: every candidate skinny config vs F.linear; autotune() + install() -> each linear layer returns
#      exactly what the table names and matches F.linear (test/gpu/test_decode_gemm_gpu.py).
#   2. benchmark/decode/gemm_tune.py: per (Llama-3.1-8B linear shape, M in 1/8/16/32/64/128) cuBLAS vs the
#      best skinny config, fraction of copy bandwidth, the chosen kernel, per-step GEMM estimate -> decode_gemm_tune.md.
#   3. benchmark/decode/step_ab.py --settings new --prefill-tokens 0 --serving --serving-modes overlap, twice:
#      SGLANG_DECODE_GEMM_AUTOTUNE=0 then =1 (separate processes, same batches 1/32/128 x 1024): floor, graph replay,
#      harness step and the served step (overlap scheduler with device futures, as the server runs on CUDA).
#      (ISSUE27_GEMM_ORDER="on off" swaps the order, to alternate it between rounds).
#   4. the off/on A/B table appended to decode_gemm_tune.md; the runner's logged table (autotune on) printed.
# Usage (repo root; data at ../shared/data or carried as .sd/): bash scripts/gpu/issue27_gemm_1gpu.sh
# Writes under $OUT: decode_gemm_tune.md, issue27_gemm_{pytest,bench,ab_off,ab_on}.log, off/ and on/ (decode_ab md/json).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # cds to the repo root ($root), NVLS off, carried wheels and data
export OUT="${OUT:-/tmp/issue27_gemm}"; mkdir -p "$OUT/off" "$OUT/on"
unset TRITON_INTERPRET SGLANG_SKINNY_GEMM SGLANG_DECODE_GEMM_MAX_M
model="$root/../shared/data/configs/meta-llama--Meta-Llama-3.1-8B"
. "$root/scripts/gpu/lib_budget.sh"  # start_run, left, elapsed, stage, cap
cap_margin=5
declare -A rc
rc[ab_off]=skipped; rc[ab_on]=skipped

start_run "$OUT/issue27_gemm_run.log" "${ISSUE27_GEMM_BUDGET_S:-150}"  # the environment stage: commit, GPU, versions

stage "1. GPU tests: skinny candidates vs F.linear, autotuned dispatch vs F.linear"
timeout -k 5 "$(cap 45)" $PY -m pytest -q -p no:cacheprovider -m gpu test/gpu/test_decode_gemm_gpu.py \
  > "$OUT/issue27_gemm_pytest.log" 2>&1
rc[tests]=$?
grep -E "passed|failed|skipped|Error|assert" "$OUT/issue27_gemm_pytest.log" | tail -n 8

stage "2. decode GEMMs: cuBLAS vs best skinny per (shape, M), fraction of copy bandwidth"
timeout -k 5 "$(cap 30)" $PY benchmark/decode/gemm_tune.py --out "$OUT" --model-path "$model" \
  > "$OUT/issue27_gemm_bench.log" 2>&1
rc[bench]=$?
[[ ${rc[bench]} == 0 ]] || tail -n 8 "$OUT/issue27_gemm_bench.log"

ab_args=(--model-path "$model" --settings new --steps 8 --reps 1 --prefill-tokens 0 --serving
         --serving-modes overlap --serving-steps 24 --serving-warmup 4 --serving-reps 1)
for tag in ${ISSUE27_GEMM_ORDER:-off on}; do  # ISSUE27_GEMM_ORDER="on off" runs the other order
  if (( $(left) < 25 )); then echo "skip autotune $tag: $(left) s left"; continue; fi
  stage "3. decode step with SGLANG_DECODE_GEMM_AUTOTUNE=$([[ $tag == on ]] && echo 1 || echo 0) ($(left) s left)"
  per=$(( $(left) - 8 )); [[ -z "${done_first:-}" ]] && per=$(( per / 2 )); done_first=1
  SGLANG_DECODE_GEMM_AUTOTUNE=$([[ $tag == on ]] && echo 1 || echo 0) timeout -k 5 "$(cap $per)" \
    $PY benchmark/decode/step_ab.py --out "$OUT/$tag" "${ab_args[@]}" > "$OUT/issue27_gemm_ab_$tag.log" 2>&1
  rc[ab_$tag]=$?
  grep -E "decode GEMM autotune on|serving bs|Error|error" "$OUT/issue27_gemm_ab_$tag.log" | cut -c1-200 | tail -n 6
done

stage "4. summary"
$PY benchmark/decode/gemm_tune.py --out "$OUT" --ab-off "$OUT/off" --ab-on "$OUT/on" > /dev/null 2>&1 \
  || echo "A/B table failed rc=$?"
{
  echo "# Issue 27 decode-GEMM autotune ($(date -u +%FT%TZ), ${gpu:-GPU unknown}, $commit)"
  echo
  echo "rc: tests=${rc[tests]} gemm_bench=${rc[bench]} ab_off=${rc[ab_off]} ab_on=${rc[ab_on]}"
  echo "tests: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/issue27_gemm_pytest.log" | tail -n 1)"
  echo
  cat "$OUT/decode_gemm_tune.md" 2>/dev/null || echo "(no decode_gemm_tune.md)"
  echo
  echo "Runner's table (autotune on):"
  grep -A 40 "decode GEMM autotune on" "$OUT/issue27_gemm_ab_on.log" 2>/dev/null | grep -E "autotune on|N=" \
    | cut -c1-160 | head -n 30
} > "$OUT/issue27_gemm_summary.md" 2>&1
cat "$OUT/issue27_gemm_summary.md"
echo "issue27_gemm total $(elapsed) s"
