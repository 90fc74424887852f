#!/usr/bin/env bash
# FP8 KV cache (--kv-cache-dtype fp8_e4m3) on ONE H100 / H200, in two parts that each fit one device call:
#   check   (~200 s): 1. test/gpu/test_fp8_kv_gpu.py (FP8 decode / extend kernels vs the torch reference on fresh
#                        random inputs, head dims 64/128/256, pages 1 and 16; fused RoPE + FP8 store byte-equal to
#                        RoPE + the pool's quantization; decode kernel and ModelRunner decode in CUDA graphs == eager)
#                     2. regression of the kernels whose signatures changed (test_triton_kernels_gpu.py: BF16 decode,
#                        extend, fused RoPE + store, graph replay) and test_gpu_correctness.py's graph check
#                     3. benchmark/attention/bench_fp8_kv_decode.py (decode attention BF16 vs FP8 KV, batch 1/32/128,
#                        context 1K/4K, against the copy-bandwidth floor)
#   serving (~380 s): benchmark/quantization/bench_kv_cache_dtype_serving.py: Llama-3.1-8B config, dummy weights,
#                     llama3 tokenizer, random 4096/2048, range ratio 0.0, 500 prompts, rate inf; auto then fp8_e4m3
#                     (FP8_KV_REPEATS=2 adds a reversed round: ~750 s, two calls' worth)
# Usage (repo root; data at ../shared/data or carried as .sd/):
#   OUT=/tmp/out bash scripts/gpu/fp8_kv_1gpu.sh check   [budget_s=280]
#   OUT=/tmp/out bash scripts/gpu/fp8_kv_1gpu.sh serving [budget_s=560]
# DRY_RUN=1 prints the commands without running them. Summary: $OUT/fp8_kv_<part>.md
set -uo pipefail
part="${1:-check}"
. "$(dirname "$0")/device_preamble.sh"
OUT="${OUT:-/tmp/fp8_kv_out}"; mkdir -p "$OUT"
. "$root/scripts/gpu/lib_budget.sh"
case "$part" in
  check) default_budget=280 ;;
  serving) default_budget=560 ;;
  *) echo "usage: $0 check|serving [budget_s]"; exit 2 ;;
esac
step_dry="${DRY_RUN:-}"
start_run "$OUT/fp8_kv_${part}_run.log" "${2:-$default_budget}"
model="${FP8_KV_MODEL:-../shared/data/configs/meta-llama--Meta-Llama-3.1-8B}"

if [[ "$part" == "check" ]]; then
  stage "1. FP8 KV GPU tests"
  step fp8_kv_gpu_tests "$(cap 150)" $PY -m pytest -q -s -p no:cacheprovider -m gpu test/gpu/test_fp8_kv_gpu.py
  stage "2. regression: BF16 kernels with the new scale arguments, graph replay"
  step_reserve=60 step kernels_regression 90 $PY -m pytest -q -p no:cacheprovider -m gpu \
    test/gpu/test_triton_kernels_gpu.py test/gpu/test_gpu_correctness.py -k "rope_and_store or decode_vs_torch_native \
or extend_and_mixed or decode_cuda_graph_replay or (cuda_graph_replay_equals_eager and llama)"
  stage "3. decode attention kernel: BF16 vs FP8 KV against the memory floor"
  step decode_attention_bench "$(cap 90)" $PY benchmark/attention/bench_fp8_kv_decode.py --out "$OUT"
else
  stage "serving A/B: --kv-cache-dtype auto vs fp8_e4m3 (random 4096/2048, 500 prompts, rate inf)"
  step kv_cache_dtype_serving "$(cap 540)" $PY benchmark/quantization/bench_kv_cache_dtype_serving.py --out "$OUT" \
    --model-path "$model" --repeats "${FP8_KV_REPEATS:-1}" --timeout 330
fi

stage "summary"
{
  echo "# FP8 KV cache, part $part ($(date -u +%FT%TZ), ${gpu:-GPU unknown}, commit $commit)"
  echo
  printf -- '- %s\n' "${summary[@]}"
  for f in "$OUT/fp8_kv_gpu_tests.log" "$OUT/kernels_regression.log"; do
    [[ -s "$f" ]] && { echo; echo "$(basename "$f"): $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -n 1)"; \
      grep -E '^(FAILED|ERROR)' "$f" | head -n 10; }
  done
  for f in "$OUT/fp8_kv_decode.md" "$OUT/kv_cache_dtype_serving.md"; do
    [[ -s "$f" ]] && { echo; cat "$f"; }
  done
} > "$OUT/fp8_kv_${part}.md" 2>&1
cat "$OUT/fp8_kv_${part}.md"
