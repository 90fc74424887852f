#!/usr/bin/env bash
# Issue 27 item 2, round "2" of the decode gap, on ONE H100 or H200 (budget ISSUE27_BUDGET_S, default 240 s wall,
# Triton compile and the decode-GEMM autotune included), in priority order:
#   1. GPU test: every skinny decode-GEMM candidate (incl. the two new tiles) and the autotuned dispatch == F.linear
#      (test/gpu/test_decode_gemm_gpu.py); compiles the candidate kernels, so the tune in step 2 hits Triton's cache.
#   2. benchmark/decode/step_ab.py --gemm-ab, ONE process (Llama-3.1-8B config, dummy weights, batch 1/32/128 x 1024):
#      copy bandwidth (the floor) measured first; two CUDA-graph sets, the default (cuBLAS) and
#      SGLANG_DECODE_GEMM_AUTOTUNE=1 (tuned before its capture; tune time reported); per batch the served step
#      (Scheduler overlap loop with device futures, as the server runs) and the graph replay alone vs the floor,
#      order alternated (cublas, autotune, autotune, cublas); then per set one replay profiled by kernel class
#      (GEMMs by layer role qkv / o / gate_up / down / lm_head, attention, norm, rope_kv, act, sampling, copies) with
#      the bytes each must move, its bandwidth vs the copy bandwidth and its time above its own floor.
#   3. summary -> $OUT/issue27_2_summary.md (GPU name, commit, rc of each step, the tables).
# Usage (repo root; data at ../shared/data or carried as .sd/): bash scripts/gpu/issue27_2_1gpu.sh
# Writes under $OUT: issue27_2_summary.md, decode_step_ab.{md,json}, issue27_2_{pytest,ab,run}.log.
set -uo pipefail
. "$(dirname "$0")/issue27_common.sh" issue27_2 240  # preamble, $OUT, tee, budget helpers, model, gpu
rc[tests]=skipped; rc[ab]=skipped

stage "environment (commit $commit)"
echo "GPU: ${gpu:-unknown}"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" || true

stage "1. GPU test: skinny candidates + autotuned dispatch vs F.linear"
timeout -k 5 "$(cap 50)" $PY -m pytest -q -p no:cacheprovider -m gpu test/gpu/test_decode_gemm_gpu.py \
  > "$OUT/issue27_2_pytest.log" 2>&1
rc[tests]=$?
grep -E "passed|failed|skipped|Error|assert" "$OUT/issue27_2_pytest.log" | tail -n 6

stage "2. one process: floor, cuBLAS vs autotune graph sets, served step + replay alternated, per-class breakdown"
timeout -k 10 "$(cap 300)" $PY benchmark/decode/step_ab.py --out "$OUT" --model-path "$model" --gemm-ab \
  --batches 1,32,128 --settings none --prefill-tokens 0 --serving-steps 16 --serving-warmup 3 --serving-reps 2 \
  > "$OUT/issue27_2_ab.log" 2>&1
rc[ab]=$?
grep -E "captured in|autotune on|gemm A/B bs|breakdown .* failed|Error|error" "$OUT/issue27_2_ab.log" \
  | cut -c1-220 | tail -n 14

stage "3. summary"
{
  echo "# Issue 27 decode gap, one GPU ($(date -u +%FT%TZ), ${gpu:-GPU unknown}, commit $commit)"
  echo
  echo "Command: \`ISSUE27_BUDGET_S=$budget bash scripts/gpu/issue27_2_1gpu.sh\`"
  echo "rc: tests=${rc[tests]} gemm_ab=${rc[ab]} (124/137 = hit its timeout)"
  echo "tests: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/issue27_2_pytest.log" 2>/dev/null | tail -n 1)"
  echo
  if [[ -s "$OUT/decode_step_ab.md" ]]; then
    cat "$OUT/decode_step_ab.md"
  else
    echo "(no decode_step_ab.md; last log lines:)"; tail -n 20 "$OUT/issue27_2_ab.log" 2>/dev/null
  fi
} > "$OUT/issue27_2_summary.md" 2>&1
cat "$OUT/issue27_2_summary.md"
echo "issue27_2 total $(( $(date +%s) - t_start )) s"
