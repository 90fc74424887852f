#!/usr/bin/env bash
# Issue 27, round 1 on ONE H100/H200 (budget 300 s wall, compile included), in priority order:
#   1. GPU test: Llama-3.1-8B config (dummy bf16) at the DEFAULTS runs a static batch of 128 x 1024 prompt tokens and
#      the largest forward the scheduler can form beside a full KV pool, no OOM; the batch's activation peak stays
#      within the reserve measured by the profiling forwards at start (test/gpu/test_memory_budget_gpu.py).
#   2. SGLang's CLI at the defaults: python -m sglang.bench_one_batch ... --batch-size 1 32 128 --input-len 1024
#      --output-len 32 (this failed with OOM at batch 128 before issue 27).
#   3. benchmark/bench_decode_ab.py in one process: copy-bandwidth floor + matmul rate; floors for step 2's lines;
#      decode A/B of SGLANG_DECODE_FUSED_REDUCE / SGLANG_GRAPH_GREEDY (off, fr, gg, both; order alternated) with
#      per-step graph-node counts, host time inside ModelRunner.forward and replay-only GPU time; 8K-token prefill
#      vs the matmul rate.
#   4. If >= 110 s are left: one server at the defaults + bench_serving random 1024/256 @64 (128 prompts), then
#      ShareGPT @64 (200 prompts) if >= 45 s are left (needs the carried wheels in .whl/ for fastapi/uvicorn/...,
#      installed by device_preamble.sh, and the data in ../shared/data or .sd/).
# Usage (repo root; data at ../shared/data or carried as .sd/): bash scripts/gpu/issue27_1gpu.sh
# Writes under $OUT: issue27_summary.md (the tables), issue27_decode_ab.{md,json}, issue27_cli.jsonl, issue27_*.log.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # cds to the repo root ($root), NVLS off, carried wheels and data
export OUT="${OUT:-/tmp/issue27}"; mkdir -p "$OUT"
unset TRITON_INTERPRET SGLANG_DECODE_FUSED_REDUCE SGLANG_GRAPH_GREEDY SGLANG_TRITON_DECODE_LEGACY
data="$root/../shared/data"
model="$data/configs/meta-llama--Meta-Llama-3.1-8B"; tok="$data/tokenizers/llama3"
exec > >(tee -a "$OUT/issue27_run.log") 2>&1
t_start=$(date +%s); budget=${ISSUE27_BUDGET_S:-295}
left() { echo $(( budget - ($(date +%s) - t_start) )); }
stage() { echo; echo "== $1 ($(( $(date +%s) - t_start )) s elapsed)"; }
cap() { local want=$1 l=$(( $(left) - 10 )); (( l < want )) && want=$l; (( want < 5 )) && want=5; echo "$want"; }
declare -A rc

stage "environment"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" || true

stage "1. GPU test: batch 128 x 1K at the defaults (Llama-3.1-8B config, dummy weights)"
timeout -k 10 "$(cap 130)" $PY -m pytest -q -s -p no:cacheprovider test/gpu/test_memory_budget_gpu.py -m gpu \
  > "$OUT/issue27_gpu_test.log" 2>&1
rc[test]=$?
grep -E "KV pool|batch 128|largest step|passed|failed|skipped|Error|error" "$OUT/issue27_gpu_test.log" | tail -n 12

stage "2. bench_one_batch at the defaults, batch 1 32 128 x 1024 in / 32 out"
rm -f "$OUT/issue27_cli.jsonl"
timeout -k 10 "$(cap 90)" $PY -m sglang.bench_one_batch --model-path "$model" \
  --load-format dummy --tokenizer-path "$tok" --dtype bfloat16 --device cuda --batch-size 1 32 128 \
  --input-len 1024 --output-len 32 --result-filename "$OUT/issue27_cli.jsonl" > "$OUT/issue27_cli.log" 2>&1
rc[cli]=$?
grep -E "activation reserve|KV cache|Prefill\.|median|Error|error" "$OUT/issue27_cli.log" | tail -n 12

stage "3. floors + decode A/B of the graph-node switches + 8K prefill (one process)"
timeout -k 10 "$(cap 120)" $PY benchmark/bench_decode_ab.py --out "$OUT" \
  --cli-results "$OUT/issue27_cli.jsonl" > "$OUT/issue27_decode_ab.log" 2>&1
rc[ab]=$?
grep -E "captured|bs [0-9]+ |Error|error" "$OUT/issue27_decode_ab.log" | tail -n 16

stage "4. serving at the defaults: bench_serving random 1024/256 @64 ($(left) s left)"
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
      echo "== 4b. ShareGPT, 200 prompts @64 ($(left) s left)"
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

stage "summary"
{
  echo "# Issue 27 round 1 ($(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
  echo
  echo "rc: gpu_test=${rc[test]} bench_one_batch=${rc[cli]} decode_ab=${rc[ab]} serving=${rc[serving]}"
  echo
  grep -E "KV pool|batch 128 x 1024|largest step" "$OUT/issue27_gpu_test.log" | sed 's/^/    /'
  echo
  if [[ -f "$OUT/issue27_decode_ab.md" ]]; then cat "$OUT/issue27_decode_ab.md"; else
    echo "(no decode A/B table; bench_one_batch lines:)"; grep -E "median" "$OUT/issue27_cli.log"; fi
  if compgen -G "$OUT/issue27_serving_*.jsonl" > /dev/null; then
    echo; echo "## bench_serving @64 (random 1024/256: 128 prompts; ShareGPT: 200 prompts), server at the defaults"
    $PY - "$OUT"/issue27_serving_*.jsonl <<'PYEOF'
import json, os, sys
keys = ["completed", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
        "p99_itl_ms", "mean_tpot_ms"]
print("| workload | " + " | ".join(keys) + " |"); print("|---|" + "---:|" * len(keys))
for path in sys.argv[1:]:
    lines = [l for l in open(path) if l.strip()]
    if not lines:
        continue
    r = json.loads(lines[-1])
    cells = [f"{r[k]:.1f}" if isinstance(r.get(k), float) else str(r.get(k, "n/a")) for k in keys]
    print(f"| {os.path.basename(path)[len('issue27_serving_'):-6]} | " + " | ".join(cells) + " |")
PYEOF
  fi
} > "$OUT/issue27_summary.md" 2>&1
cat "$OUT/issue27_summary.md"
echo "issue27 total $(( $(date +%s) - t_start )) s"
