#!/usr/bin/env bash
# Issue 27, round 2 on ONE H100/H200 (budget 300 s wall, compile included), in priority order:
#   1. GPU tests of what round 2 changed: the graph argmax (always captured now) equals the sampler, graph replay ==
#      eager (packed input staging), extend attention (longest query blocks first) vs torch_native, decode graph
#      replay == eager.
#   2. SGLang's CLI at the defaults: python -m sglang.bench_one_batch ... --batch-size 1 32 128 --input-len 1024
#      --output-len 32 (the new host path: sampling info reused, one packed input copy, graph argmax).
#   3. benchmark/bench_decode_ab.py in one process: copy-bandwidth floor + matmul rate; floors for step 2's lines;
#      decode with the host path old (before issue 27) vs new on the same graphs (order alternated) with graph-node
#      counts, host time before/inside ModelRunner.forward and replay-only GPU time; 8K-token prefill vs the matmul
#      rate; GPU time by kernel category of one replay per batch and of the prefill (--breakdown).
#   4. benchmark/bench_decode_host.py --device cuda: the host part of a step, old vs new, with real pinned copies;
#      benchmark/bench_extend_configs.py: the prefill attention kernel's tile configs at 8K vs torch SDPA.
#   5. If >= 80 s are left: the memory GPU test of round 1 (batch 128 x 1K at the defaults, largest step).
#   6. If >= 110 s are left: one server at the defaults + bench_serving random 1024/256 @64 (128 prompts), then
#      ShareGPT @64 (200 prompts) if >= 45 s are left (needs the carried wheels in .whl/ for fastapi/uvicorn/...,
#      installed by device_preamble.sh, and the data in ../shared/data or .sd/).
#   7. benchmark/issue27_report.py writes $OUT/<date>_issue27_one_gpu.md (the results file, for benchmark/results/).
# Usage (repo root; data at ../shared/data or carried as .sd/): bash scripts/gpu/issue27_1gpu.sh
# Writes under $OUT: <date>_issue27_one_gpu.md, issue27_summary.md, issue27_decode_ab.{md,json}, issue27_cli.jsonl,
# host_cuda/decode_host.{md,json}, issue27_*.log.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # cds to the repo root ($root), NVLS off, carried wheels and data
export OUT="${OUT:-/tmp/issue27}"; mkdir -p "$OUT"
unset TRITON_INTERPRET SGLANG_TRITON_DECODE_LEGACY
data="$root/../shared/data"
model="$data/configs/meta-llama--Meta-Llama-3.1-8B"; tok="$data/tokenizers/llama3"
commit="${ISSUE27_COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
exec > >(tee -a "$OUT/issue27_run.log") 2>&1
t_start=$(date +%s); budget=${ISSUE27_BUDGET_S:-295}
left() { echo $(( budget - ($(date +%s) - t_start) )); }
stage() { echo; echo "== $1 ($(( $(date +%s) - t_start )) s elapsed)"; }
cap() { local want=$1 l=$(( $(left) - 10 )); (( l < want )) && want=$l; (( want < 5 )) && want=5; echo "$want"; }
declare -A rc
rc[memtest]=skipped

stage "environment (commit $commit)"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" || true

stage "1. GPU tests: graph argmax == sampler, graph replay == eager, extend attention, decode graph replay"
timeout -k 10 "$(cap 80)" $PY -m pytest -q -p no:cacheprovider -m gpu test/gpu/test_gpu_correctness.py \
  test/gpu/test_triton_kernels_gpu.py -k "graph_greedy or cuda_graph_replay_equals_eager or extend_and_mixed" \
  > "$OUT/issue27_pytest.log" 2>&1
rc[tests]=$?
grep -E "passed|failed|skipped|Error" "$OUT/issue27_pytest.log" | tail -n 8

stage "2. bench_one_batch at the defaults, batch 1 32 128 x 1024 in / 32 out"
rm -f "$OUT/issue27_cli.jsonl"
timeout -k 10 "$(cap 60)" $PY -m sglang.bench_one_batch --model-path "$model" \
  --load-format dummy --tokenizer-path "$tok" --dtype bfloat16 --device cuda --batch-size 1 32 128 \
  --input-len 1024 --output-len 32 --result-filename "$OUT/issue27_cli.jsonl" > "$OUT/issue27_cli.log" 2>&1
rc[cli]=$?
grep -E "activation reserve|KV cache|Prefill\.|median|Error|error" "$OUT/issue27_cli.log" | tail -n 12

stage "3. floors + decode host path old vs new + 8K prefill + kernel breakdown (one process)"
timeout -k 10 "$(cap 90)" $PY benchmark/bench_decode_ab.py --out "$OUT" --breakdown \
  --cli-results "$OUT/issue27_cli.jsonl" > "$OUT/issue27_decode_ab.log" 2>&1
rc[ab]=$?
grep -E "captured|bs [0-9]+ |breakdown|Error|error" "$OUT/issue27_decode_ab.log" | tail -n 14

stage "4. host part of a decode step on this machine (old vs new, pinned copies)"
timeout -k 5 "$(cap 30)" $PY benchmark/bench_decode_host.py --device cuda --iters 100 --out "$OUT/host_cuda" \
  > "$OUT/issue27_host.log" 2>&1
rc[host]=$?
tail -n 6 "$OUT/issue27_host.log"

stage "4b. extend attention tile configs at one 8K causal prefill vs torch SDPA (same run)"
timeout -k 5 "$(cap 45)" $PY benchmark/bench_extend_configs.py --out "$OUT" > "$OUT/issue27_extend.log" 2>&1
rc[extend]=$?
tail -n 11 "$OUT/issue27_extend.log"

if (( $(left) >= 80 )); then
  stage "5. memory GPU test: batch 128 x 1K at the defaults ($(left) s left)"
  timeout -k 10 "$(cap 45)" $PY -m pytest -q -s -p no:cacheprovider test/gpu/test_memory_budget_gpu.py -m gpu \
    > "$OUT/issue27_gpu_test.log" 2>&1
  rc[memtest]=$?
  grep -E "KV pool|batch 128|largest step|passed|failed|skipped|Error|error" "$OUT/issue27_gpu_test.log" | tail -n 8
fi

stage "6. serving at the defaults: bench_serving random 1024/256 @64 ($(left) s left)"
rc[serving]=skipped
if (( $(left) >= 110 )); then
  port=30227
  $PY -m sglang.launch_server --model-path "$model" --tokenizer-path "$tok" --load-format dummy --dtype bfloat16 \
    --device cuda --port "$port" > "$OUT/issue27_server.log" 2>&1 &
  srv=$!
  ok=0
  while (( $(left) > 45 )); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then ok=1; break; fi
    kill -0 "$srv" 2>/dev/null || break
    sleep 1
  done
  if (( ok )); then
    echo "server healthy after $(( $(date +%s) - t_start )) s elapsed"
    timeout -k 5 "$(cap 100)" $PY -m sglang.bench_serving --backend sglang --port "$port" --tokenizer "$tok" \
      --dataset-name random --random-input-len 1024 --random-output-len 256 --random-range-ratio 1 \
      --num-prompts 128 --max-concurrency 64 --disable-tqdm --output-file "$OUT/issue27_serving_random.jsonl" \
      > "$OUT/issue27_serving.log" 2>&1
    rc[serving]=$?
    tail -n 22 "$OUT/issue27_serving.log"
    if (( $(left) >= 45 )); then
      echo "== 6b. ShareGPT, 200 prompts @64 ($(left) s left)"
      timeout -k 5 "$(cap 60)" $PY -m sglang.bench_serving --backend sglang --port "$port" --tokenizer "$tok" \
        --dataset-name sharegpt --dataset-path "$data/datasets/sharegpt/ShareGPT_V3_filtered_1000.json" \
        --num-prompts 200 --max-concurrency 64 --disable-tqdm --output-file "$OUT/issue27_serving_sharegpt.jsonl" \
        > "$OUT/issue27_serving_sharegpt.log" 2>&1 || echo "sharegpt rc=$?"
    fi
  else
    rc[serving]=unhealthy
    tail -n 30 "$OUT/issue27_server.log"
  fi
  kill -TERM "$srv" 2>/dev/null; sleep 3; kill -KILL "$srv" 2>/dev/null
  grep -E "activation reserve|KV cache|captured" "$OUT/issue27_server.log" | tail -n 3
  tail -n 150 "$OUT/issue27_server.log" > "$OUT/issue27_server.log.tail" && mv "$OUT/issue27_server.log.tail" \
    "$OUT/issue27_server.log"
fi

stage "7. summary and results file"
{
  echo "# Issue 27 round 2 ($(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $commit)"
  echo
  echo "rc: tests=${rc[tests]} bench_one_batch=${rc[cli]} decode_ab=${rc[ab]} host=${rc[host]}" \
    "extend=${rc[extend]} memory_test=${rc[memtest]} serving=${rc[serving]}"
  echo
  if [[ -f "$OUT/issue27_decode_ab.md" ]]; then cat "$OUT/issue27_decode_ab.md"; else
    echo "(no decode table; bench_one_batch lines:)"; grep -E "median" "$OUT/issue27_cli.log"; fi
  echo; cat "$OUT/host_cuda/decode_host.md" 2>/dev/null || echo "(no host micro-benchmark table)"
  echo; cat "$OUT/extend_configs.md" 2>/dev/null || echo "(no extend config table)"
} > "$OUT/issue27_summary.md" 2>&1
cat "$OUT/issue27_summary.md"
$PY benchmark/issue27_report.py --out "$OUT" --commit "$commit" --round 2 \
  --command "bash scripts/gpu/issue27_1gpu.sh (ISSUE27_BUDGET_S=$budget)" || echo "results writer failed rc=$?"
grep -E "^\| (1|32|128) \| (old|new) " "$OUT"/*_issue27_one_gpu.md 2>/dev/null | head -n 6
echo "issue27 total $(( $(date +%s) - t_start )) s"
