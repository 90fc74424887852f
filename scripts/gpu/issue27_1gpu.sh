#!/usr/bin/env bash
# Issue 27 item 2 (decode within 1.3x / 1.2x of the memory floor), round 4, on ONE H100 or H200 (budget
# ISSUE27_BUDGET_S, default 280 s wall, compile included), in priority order:
#   1. GPU tests: CUDA-graph replay == eager (llama, mixtral, qwen3; and the decode kernel's), graph argmax ==
#      sampler, the decode split rules vs torch_native, and the overlap scheduler with device futures == the plain
#      loop on stories260K
#      (CUDA graphs, fp32, greedy + seeded sampling, requests joining mid-decode).
#   2. SGLang's CLI at the defaults: python -m sglang.bench_one_batch ... --batch-size 1 32 128 --input-len 1024
#      --output-len 32 (its own process).
#   3. benchmark/decode/step_ab.py --serving in one process: copy-bandwidth floor (measured here, never assumed),
#      the harness decode step (new host path), graph replay alone, and the serving path's steady decode step
#      (Scheduler loop + runner + graphs: overlap off / overlap with host futures / overlap with device futures
#      = what the server runs on CUDA now), order alternated, at batch 1 / 32 / 128 x 1024-token prompts.
#   4. the memory GPU test (batch 128 x 1K at the defaults).
#   5. if time is left: decode attention tile configs in CUDA graphs (benchmark/decode/attention_configs.py).
#   6. benchmark/decode/gpu_round_report.py: $OUT/<date>_decode_one_gpu.md with a status table vs the targets.
# Usage (repo root; data at ../shared/data or carried as .sd/): bash scripts/gpu/issue27_1gpu.sh
# Writes under $OUT: <date>_decode_one_gpu.md, issue27_summary.md, decode_step_ab.{md,json}, issue27_cli.jsonl,
# decode_attention_configs.md, issue27_*.log.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # cds to the repo root ($root), NVLS off, carried wheels and data
export OUT="${OUT:-/tmp/issue27}"; mkdir -p "$OUT"
unset TRITON_INTERPRET SGLANG_TRITON_DECODE_LEGACY
data="$root/../shared/data"
model="$data/configs/meta-llama--Meta-Llama-3.1-8B"; tok="$data/tokenizers/llama3"
. "$root/scripts/gpu/lib_budget.sh"  # start_run, left, elapsed, stage, cap
commit="${ISSUE27_COMMIT:-}"
cap_margin=10
declare -A rc
rc[memtest]=skipped; rc[configs]=skipped

start_run "$OUT/decode_run.log" "${ISSUE27_BUDGET_S:-280}"  # the environment stage: commit, GPU, versions
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true

stage "1. GPU tests: graph replay == eager (all archs), graph argmax, decode split rules vs torch, overlap device futures"
timeout -k 10 "$(cap 110)" $PY -m pytest -q -p no:cacheprovider -m gpu test/gpu/test_gpu_correctness.py \
  test/gpu/test_triton_kernels_gpu.py test/gpu/test_overlap_device_futures_gpu.py \
  -k "cuda_graph_replay_equals_eager or graph_greedy_ids or decode_split_rules or overlap" \
  > "$OUT/decode_pytest.log" 2>&1
rc[tests]=$?
grep -E "passed|failed|PASSED|FAILED|skipped|Error" "$OUT/decode_pytest.log" | tail -n 10

stage "2. bench_one_batch at the defaults, batch 1 32 128 x 1024 in / 32 out"
rm -f "$OUT/issue27_cli.jsonl"
timeout -k 10 "$(cap 65)" $PY -m sglang.bench_one_batch --model-path "$model" \
  --load-format dummy --tokenizer-path "$tok" --dtype bfloat16 --device cuda --batch-size 1 32 128 \
  --input-len 1024 --output-len 32 --result-filename "$OUT/issue27_cli.jsonl" > "$OUT/issue27_cli.log" 2>&1
rc[cli]=$?
grep -E "activation reserve|KV cache|median|Error|error" "$OUT/issue27_cli.log" | tail -n 8

stage "3. floors + harness decode step + serving-path decode step (overlap off / host / device futures), one process"
timeout -k 10 "$(cap 110)" $PY benchmark/decode/step_ab.py --out "$OUT" --settings new --steps 8 --reps 2 \
  --prefill-tokens 0 --serving --serving-steps 24 --serving-warmup 4 --serving-reps 2 \
  --cli-results "$OUT/issue27_cli.jsonl" > "$OUT/decode_step_ab.log" 2>&1
rc[ab]=$?
grep -E "captured|bs [0-9]+ |serving bs|Error|error" "$OUT/decode_step_ab.log" | tail -n 16

if (( $(left) >= 45 )); then
  stage "4. memory GPU test: batch 128 x 1K at the defaults ($(left) s left)"
  timeout -k 10 "$(cap 55)" $PY -m pytest -q -s -p no:cacheprovider test/gpu/test_memory_budget_gpu.py -m gpu \
    > "$OUT/decode_gpu_test.log" 2>&1
  rc[memtest]=$?
  grep -E "KV pool|batch 128|largest step|passed|failed|skipped|Error|error" "$OUT/decode_gpu_test.log" | tail -n 6
fi

if (( $(left) >= 35 )); then
  stage "5. decode attention tile configs inside CUDA graphs, batch 1 / 32 / 128 x 1024 ($(left) s left)"
  timeout -k 5 "$(cap 30)" $PY benchmark/decode/attention_configs.py --out "$OUT" > "$OUT/issue27_configs.log" 2>&1
  rc[configs]=$?
  cat "$OUT/decode_attention_configs.md" 2>/dev/null || tail -n 8 "$OUT/issue27_configs.log"
fi

stage "6. summary and results file"
$PY benchmark/decode/gpu_round_report.py --out "$OUT" --commit "$commit" --round 4 \
  --command "bash scripts/gpu/issue27_1gpu.sh (ISSUE27_BUDGET_S=$budget)" > "$OUT/issue27_report.log" 2>&1 \
  || echo "results writer failed rc=$?"
res=$(ls "$OUT"/*_decode_one_gpu.md 2>/dev/null | head -1)
{
  echo "# Issue 27 round 4 ($(date -u +%FT%TZ), ${gpu:-GPU unknown}, $commit)"
  echo
  echo "rc: tests=${rc[tests]} bench_one_batch=${rc[cli]} decode_ab=${rc[ab]} memory_test=${rc[memtest]}" \
    "decode_configs=${rc[configs]}"
  echo
  if [[ -n "$res" ]]; then
    awk '/^## Decode status/{on=1} on&&/^## /&&!/^## Decode status/{on=0} on' "$res"
    awk '/^## Decode step of the serving path/{on=1} on&&/^## /&&!/serving path/{on=0} on' "$res"
    awk '/^## Correctness/{on=1} on&&/^## /&&!/^## Correctness/{on=0} on' "$res"
    cat "$OUT/decode_attention_configs.md" 2>/dev/null
  else
    echo "(no results file; bench_one_batch lines:)"; grep -E "median" "$OUT/issue27_cli.log"
  fi
} > "$OUT/issue27_summary.md" 2>&1
cat "$OUT/issue27_summary.md"
echo "issue27 total $(elapsed) s"
