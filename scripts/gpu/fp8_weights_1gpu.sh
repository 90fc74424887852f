#!/usr/bin/env bash
# FP8 weights (--quantization fp8, FP8 checkpoints) on ONE H100 / H200. Stages (arguments, in order; default
# "tests"), each a limited step with its log under $OUT and a line in the summary:
#   tests        GPU tests: test/gpu/test_fp8_gpu.py (FP8 kernels vs torch references, decode-GEMM autotune over FP8
#                layers, CUDA-graph decode with FP8 weights vs eager, KV pool growth), then the bf16 decode-GEMM and
#                graph-vs-eager tests (the shared linear-layer code they run changed; Triton compiles) ~300-400 s
#   bench        benchmark/quantization/bench_fp8.py --sections peaks,gemm: copy bandwidth, bf16 / FP8 matmul peaks,
#                Llama-3.1-8B GEMMs at M = 1/32/128/8192 (bf16 cuBLAS vs FP8 paths, automatic choice) ~120 s
#   decode       bench_fp8.py --sections decode,prefill --serving: bf16 and FP8 runners (dummy 8B), decode at batch
#                1/32/128 x 1K context vs the memory floor (step and served step), 8K prefill vs matmul peak  ~240 s
#   offline_fp8  python -m sglang.bench_offline_throughput, SGLang's offline workload (random 4096/2048, range ratio
#                0.0, 500 prompts, seed 0) on the Llama-3.1-8B config, dummy weights, --quantization fp8 ~300 s
#   offline_bf16 the same without --quantization (the same-machine baseline)                       ~330 s
#   offline_fp8kv  the same with --quantization fp8 --kv-cache-dtype fp8_e4m3, when this checkout has that flag
# Usage (repo root): OUT=/tmp/fp8 bash scripts/gpu/fp8_weights_1gpu.sh [stages...]; FP8_BUDGET_S (default 570) caps
# the call; DRY_RUN=1 prints the commands; FP8_CPU=1 runs tests/bench/decode as their CPU variants (smoke).
# One call is at most 10 min: run "tests", then "bench decode" (~360 s), then "offline_fp8" and "offline_bf16" (~5 min
# each) as separate calls on the same warm machine.
# Writes: $OUT/fp8_weights.{md,json} (bench/decode), $OUT/offline_*.jsonl, $OUT/fp8_summary.md.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # repo root, NVLS off, carried wheels and data
export OUT="${OUT:-/tmp/fp8_weights}"; mkdir -p "$OUT"
unset SGLANG_SKINNY_GEMM SGLANG_DECODE_GEMM_MAX_M SGLANG_DECODE_GEMM_AUTOTUNE SGLANG_DECODE_FUSE_EPILOGUE
. "$root/scripts/gpu/lib_budget.sh"
stages=("$@"); (( ${#stages[@]} )) || stages=(tests)
step_dry=${DRY_RUN:-}
step_reserve=10  # every step ends 10 s before the budget (FP8_BUDGET_S)
cpu=${FP8_CPU:-}
model="$root/../shared/data/configs/meta-llama--Meta-Llama-3.1-8B"
tok="$root/../shared/data/tokenizers/llama3"
start_run "$OUT/fp8_run.log" "${FP8_BUDGET_S:-570}"

offline() {  # offline NAME [extra launch flags...]
  local name=$1; shift
  step "$name" 560 $PY -m sglang.bench_offline_throughput --model-path "$model" --load-format dummy \
    --tokenizer-path "$tok" --dtype bfloat16 --dataset-name random --random-input-len 4096 --random-output-len 2048 \
    --random-range-ratio 0.0 --num-prompts 500 --seed 0 --result-filename "$OUT/$name.jsonl" "$@"
}

for s in "${stages[@]}"; do
  case "$s" in
    tests)
      if [[ -n "$cpu" ]]; then
        step tests 560 $PY -m pytest -q -p no:cacheprovider test/unit/test_fp8_formats.py test/unit/test_fp8_models.py
      else
        step tests 540 $PY -m pytest -q -p no:cacheprovider -m gpu test/gpu/test_fp8_gpu.py \
          test/gpu/test_decode_gemm_gpu.py "test/gpu/test_gpu_correctness.py::test_cuda_graph_replay_equals_eager"
      fi ;;
    bench)
      step bench 240 $PY benchmark/quantization/bench_fp8.py --out "$OUT" --sections peaks,gemm ${cpu:+--smoke} ;;
    decode)
      step decode 420 $PY benchmark/quantization/bench_fp8.py --out "$OUT/decode" --sections peaks,decode,prefill \
        ${cpu:+--smoke} $([[ -z "$cpu" ]] && echo --serving) ;;
    offline_fp8) offline offline_fp8 --quantization fp8 ;;
    offline_bf16) offline offline_bf16 ;;
    offline_fp8kv)
      if $PY -m sglang.launch_server --help 2>/dev/null | grep -q -- "--kv-cache-dtype"; then
        offline offline_fp8kv --quantization fp8 --kv-cache-dtype fp8_e4m3
      else
        summary+=("offline_fp8kv: not run (no --kv-cache-dtype in this checkout)")
      fi ;;
    *) echo "unknown stage $s (tests bench decode offline_fp8 offline_bf16 offline_fp8kv)"; exit 2 ;;
  esac
done

stage "summary"
{
  echo "# FP8 weights ($(date -u +%FT%TZ), ${gpu:-GPU unknown}, commit ${commit:-unknown}, stages: ${stages[*]})"
  echo
  printf -- '- %s\n' "${summary[@]}"
  echo
  [[ -f "$OUT/tests.log" ]] && { echo "tests: $(grep -E '[0-9]+ (passed|failed)' "$OUT/tests.log" | tail -n 1)"; echo; }
  for f in "$OUT/fp8_weights.md" "$OUT/decode/fp8_weights.md"; do [[ -f "$f" ]] && { cat "$f"; echo; }; done
  for f in "$OUT"/offline_*.jsonl; do
    [[ -f "$f" ]] || continue
    $PY - "$f" <<'EOF'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][-1]
name = sys.argv[1].rsplit("/", 1)[-1][:-6]
print(f"{name}: output {r['output_throughput']:.1f} tok/s, total {r['total_throughput']:.1f} tok/s, "
      f"{r['successful_requests']} requests in {r['total_latency']:.1f} s")
EOF
  done
} > "$OUT/fp8_summary.md" 2>&1
cat "$OUT/fp8_summary.md"
echo "fp8_weights total $(elapsed) s"
