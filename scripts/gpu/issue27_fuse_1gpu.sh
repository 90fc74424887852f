#!/usr/bin/env bash
# Issue 27, fewer kernels per decode layer (SGLANG_DECODE_FUSE_EPILOGUE=1: split-K reduce inside the next add +
# RMSNorm, SiLU-and-mul in the gate_up skinny GEMM's epilogue), on ONE H100 or H200 (budget ISSUE27_BUDGET_S,
# default 250 s wall, Triton compile and the decode-GEMM autotunes included), in priority order:
#   1. GPU tests (test/gpu/test_decode_fuse_gpu.py): fused reduce + add + RMSNorm bit-identical to the split-K reduce
#      kernel + add + RMSNorm at the o_proj / down shapes (plain launches and PDL); gate_up + SiLU vs the torch
#      reference and the unfused pair (the share of bitwise-equal elements is printed); the tuner in fused mode, the
#      installed layers in a CUDA graph (replay == eager) vs the unfused layers.
#   2. benchmark/decode/step_ab.py --switch-ab, ONE process (Llama-3.1-8B config, dummy weights, batch 32 first, then
#      1 and 128, 1K context), sets ISSUE27_SETS (default: `default` = no switch set; `fuse` =
#      SGLANG_DECODE_FUSE_EPILOGUE=1, its own GEMM table tuned with the fused forms): served step and replay vs the
#      floor, order alternated, graph node count (kernels per step), per-class breakdown of one replay per set at
#      batch 32; the GEMM picks of both tables (fused ones tagged "[fused: ...]").
#   3. summary -> $OUT/issue27_fuse.md (GPU, commit, rc of each step, the tables).
# Usage (repo root; data at ../shared/data or carried as .sd/): bash scripts/gpu/issue27_fuse_1gpu.sh
# Writes under $OUT: issue27_fuse.md, decode_step_ab.{md,json}, issue27_fuse_{pytest,ab,run}.log.
set -uo pipefail
. "$(dirname "$0")/issue27_common.sh" issue27_fuse 250  # preamble, $OUT, tee, budget helpers, model, gpu
rc[tests]=skipped; rc[ab]=skipped

stage "environment (commit $commit)"
echo "GPU: ${gpu:-unknown}"
versions=$($PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tail -n 1)
echo "$versions"

stage "1. GPU tests: fused split-K reduce + add + RMSNorm (bitwise), gate_up + SiLU, fused tune + graph replay"
timeout -k 5 "$(cap 90)" $PY -m pytest -q -s -p no:cacheprovider -m gpu test/gpu/test_decode_fuse_gpu.py \
  > "$OUT/issue27_fuse_pytest.log" 2>&1
rc[tests]=$?
grep -E "passed|failed|skipped|Error|assert|bitwise equal" "$OUT/issue27_fuse_pytest.log" | cut -c1-200 | tail -n 14

stage "2. one process: default / SGLANG_DECODE_FUSE_EPILOGUE=1, served step + replay alternated, breakdown at 32"
sets="${ISSUE27_SETS:-default:;fuse:SGLANG_DECODE_FUSE_EPILOGUE=1}"
timeout -k 10 "$(cap 300)" $PY benchmark/decode/step_ab.py --out "$OUT" --model-path "$model" \
  --switch-ab "$sets" --switch-breakdown 32 --batches 32,1,128 --prefill-tokens 0 \
  --serving-steps 10 --serving-warmup 2 --serving-reps 2 > "$OUT/issue27_fuse_ab.log" 2>&1
rc[ab]=$?
grep -E "captured in|switch A/B bs|breakdown .* failed|Error|error" "$OUT/issue27_fuse_ab.log" | cut -c1-200 | tail -n 16

stage "3. summary"
{
  echo "# Issue 27 decode epilogue fusions, one GPU ($(date -u +%FT%TZ), ${gpu:-GPU unknown}, commit $commit)"
  echo
  echo "Command: \`ISSUE27_BUDGET_S=$budget bash scripts/gpu/issue27_fuse_1gpu.sh\`"
  echo "rc: tests=${rc[tests]} switch_ab=${rc[ab]} (124/137 = hit its timeout); $versions"
  echo "tests: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/issue27_fuse_pytest.log" 2>/dev/null | tail -n 1)"
  grep -E "bitwise equal" "$OUT/issue27_fuse_pytest.log" 2>/dev/null | sed 's/^/- /' | head -n 8
  grep -E "^(FAILED|E  )" "$OUT/issue27_fuse_pytest.log" 2>/dev/null | cut -c1-200 | head -n 8
  echo
  echo "## Decode-GEMM picks, one table per set (the fused set's table first tags its fused forms)"
  echo
  grep -E "autotune on .* in [0-9.]+ s|N=[0-9]+ K=[0-9]+ .* M<=(1|32|128):|fusions, kernels removed" "$OUT/issue27_fuse_ab.log" \
    2>/dev/null | sed -e 's/^.*\(N=\)/- \1/' -e 's/^.*\(decode GEMM autotune\)/\1/' \
    -e 's/^.*\(decode epilogue fusions, kernels removed\)/\1/' | head -n 40 || echo "(no autotune log)"
  echo
  echo "Expected: the fuse set's graph has (kernels removed at that batch's bucket, line above) fewer nodes."
  echo
  if [[ -s "$OUT/decode_step_ab.md" ]]; then
    cat "$OUT/decode_step_ab.md"
  else
    echo "(no decode_step_ab.md; last log lines:)"; tail -n 20 "$OUT/issue27_fuse_ab.log" 2>/dev/null
  fi
} > "$OUT/issue27_fuse.md" 2>&1
cat "$OUT/issue27_fuse.md"
echo "issue27_fuse total $(( $(date +%s) - t_start )) s"
