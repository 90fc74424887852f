#!/usr/bin/env bash
# Issue 19, item 3 + the GEMM choice, on ONE GPU in one device call (<= ~6 minutes):
#   1. benchmark/decode/gemm_kernels.py: decode-sized GEMMs timed inside CUDA graphs (cuBLAS, swapped cuBLAS, GEMV,
#      the skinny Triton kernel) at 1/16/32 rows, as a share of the HBM copy bandwidth measured in the same run;
#   2. one server (Llama-3.1-8B config, dummy bf16 weights, defaults: Triton attention, CUDA graphs, overlap) and
#      two bench_serving runs against it: random 1024/256 at concurrency 64 (256 prompts, the 2026-11-20 command:
#      3356 output tok/s then) and ShareGPT (../shared/data/datasets/sharegpt, 500 prompts, concurrency 64).
# Files under $OUT (<= 8): <date>_decode_gemms.md, issue19_serving_random.jsonl, issue19_serving_sharegpt.jsonl,
# issue19_server.log (tail), issue19_serving.log.
# Usage (repo root; data at ../shared/data or carried as .sd/): bash scripts/gpu/issue19_serving.sh
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # cds to the repo root ($root), NVLS off, carried wheels and data
export OUT="${OUT:-/tmp/issue19_serving}"; mkdir -p "$OUT"
unset TRITON_INTERPRET
data="$root/../shared/data"
model="$data/configs/meta-llama--Meta-Llama-3.1-8B"; tok="$data/tokenizers/llama3"
exec > >(tee -a "$OUT/issue19_serving.log") 2>&1

echo "== 1. decode GEMMs inside CUDA graphs"
timeout -k 5 120 python3 benchmark/decode/gemm_kernels.py --out "$OUT" | grep -v "^<!--" || echo "gemm bench rc=$?"

echo "== 2. server + bench_serving"
port=30219
python3 -m sglang.launch_server --model-path "$model" --tokenizer-path "$tok" --load-format dummy --dtype bfloat16 \
  --device cuda --port "$port" > "$OUT/issue19_server.log" 2>&1 &
srv=$!
ok=0
for _ in $(seq 1 150); do
  if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then ok=1; break; fi
  kill -0 "$srv" 2>/dev/null || break
  sleep 1
done
if (( ok )); then
  timeout -k 5 150 python3 -m sglang.bench_serving --backend sglang --port "$port" --tokenizer "$tok" \
    --dataset-name random --random-input-len 1024 --random-output-len 256 --random-range-ratio 1 --num-prompts 256 \
    --max-concurrency 64 --disable-tqdm --output-file "$OUT/issue19_serving_random.jsonl" | tail -n 25
  timeout -k 5 150 python3 -m sglang.bench_serving --backend sglang --port "$port" --tokenizer "$tok" \
    --dataset-name sharegpt --dataset-path "$data/datasets/sharegpt/ShareGPT_V3_filtered_1000.json" \
    --num-prompts 500 --max-concurrency 64 --disable-tqdm --output-file "$OUT/issue19_serving_sharegpt.jsonl" \
    | tail -n 25
else
  echo "server not healthy"; tail -n 40 "$OUT/issue19_server.log"
fi
kill -TERM "$srv" 2>/dev/null; sleep 5; kill -KILL "$srv" 2>/dev/null
pkill -KILL -f "sglang.launch_server" 2>/dev/null
tail -n 200 "$OUT/issue19_server.log" > "$OUT/issue19_server.log.tail" && mv "$OUT/issue19_server.log.tail" "$OUT/issue19_server.log"
echo "== done"
