#!/usr/bin/env bash
# FP8 KV cache (--kv-cache-dtype fp8_e4m3) on ONE H100 / H200, in two parts that each fit one device call:
#   check   (<= 240 s: a 230 s step budget plus the preamble):
#     1. smoke tier of test/gpu/test_fp8_kv_gpu.py (-m gpu): FP8 extend + balanced-policy decode kernels on a mixed
#        batch vs the torch reference, fused RoPE + FP8 store byte-equal to RoPE + the pool's quantization, varlen
#        prefix-free rows over FP8, the decode kernel in a CUDA graph with its metadata captured == eager; and FP8
#        weights + FP8 KV in one ModelRunner with CUDA graphs (test_fp8_gpu.py's smoke graph case)       ~60 s
#     2. regression of the BF16 kernels whose signatures changed (test_triton_kernels_gpu.py smoke cases: decode,
#        extend, fused RoPE + store, graph replay, split policies, prefix-free rows)                       ~45 s
#     3. benchmark/attention/bench_fp8_kv_decode.py (decode attention BF16 vs FP8 KV, balanced policy, batch
#        1/32/128, context 1K/4K, against the copy-bandwidth floor; 10 alternated measurements per row)   ~45 s
#     4. the gpu_extended tier of test_fp8_kv_gpu.py (head dims 64/256, E5M2, pages of 1, wave / legacy policies,
#        GPT-J RoPE, SDPA rows, ModelRunner FP8 KV graphs) in what the budget leaves                     ~80 s
#   serving (~380 s): benchmark/quantization/bench_kv_cache_dtype_serving.py: Llama-3.1-8B config, dummy weights,
#                     llama3 tokenizer, random 4096/2048, range ratio 0.0, 500 prompts, rate inf; auto then fp8_e4m3
#                     (FP8_KV_REPEATS=2 adds a reversed round: ~750 s, two calls' worth)
# FlashInfer over an FP8 cache: test_flashinfer_gpu.py::test_flashinfer_backend_reads_fp8_kv, run by
# scripts/gpu/flashinfer_attention.sh (it installs the carried FlashInfer wheels; this script does not).
# Usage (repo root; data at ../shared/data or carried as .sd/):
#   OUT=/tmp/out bash scripts/gpu/fp8_kv_1gpu.sh check   [budget_s=230]
#   OUT=/tmp/out bash scripts/gpu/fp8_kv_1gpu.sh serving [budget_s=560]
# DRY_RUN=1 prints the commands without running them. Summary: $OUT/fp8_kv_<part>.md
set -uo pipefail
part="${1:-check}"
. "$(dirname "$0")/device_preamble.sh"
OUT="${OUT:-/tmp/fp8_kv_out}"; mkdir -p "$OUT"
. "$root/scripts/gpu/lib_budget.sh"
case "$part" in
  check) default_budget=230 ;;
  serving) default_budget=560 ;;
  *) echo "usage: $0 check|serving [budget_s]"; exit 2 ;;
esac
step_dry="${DRY_RUN:-}"
start_run "$OUT/fp8_kv_${part}_run.log" "${2:-$default_budget}"
model="${FP8_KV_MODEL:-../shared/data/configs/meta-llama--Meta-Llama-3.1-8B}"

if [[ "$part" == "check" ]]; then
  step_reserve=5  # every step ends 5 s before the budget
  stage "1. FP8 KV GPU tests, smoke tier; FP8 weights + FP8 KV ModelRunner with CUDA graphs"
  step fp8_kv_gpu_tests 75 $PY -m pytest -q -s -p no:cacheprovider -m gpu test/gpu/test_fp8_kv_gpu.py \
    "test/gpu/test_fp8_gpu.py::test_cuda_graph_decode_with_fp8_weights_matches_eager"
  stage "2. regression: BF16 kernels with the new scale arguments, split policies, graph replay"
  step kernels_regression 55 $PY -m pytest -q -p no:cacheprovider -m gpu test/gpu/test_triton_kernels_gpu.py \
    -k "rope_and_store or decode_vs_torch_native or extend_and_mixed or decode_cuda_graph_replay or policies_in_graph \
or prefix_free"
  stage "3. decode attention kernel: BF16 vs FP8 KV against the memory floor"
  step decode_attention_bench 55 $PY benchmark/attention/bench_fp8_kv_decode.py --out "$OUT" --reps 10
  stage "4. FP8 KV GPU tests, extended tier (what the budget leaves)"
  step fp8_kv_gpu_extended 120 $PY -m pytest -q -s -p no:cacheprovider -m gpu_extended test/gpu/test_fp8_kv_gpu.py
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
  for f in "$OUT/fp8_kv_gpu_tests.log" "$OUT/kernels_regression.log" "$OUT/fp8_kv_gpu_extended.log"; do
    [[ -s "$f" ]] && { echo; echo "$(basename "$f"): $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -n 1)"; \
      grep -E '^(FAILED|ERROR)' "$f" | head -n 10; }
  done
  for f in "$OUT/fp8_kv_decode.md" "$OUT/kv_cache_dtype_serving.md"; do
    [[ -s "$f" ]] && { echo; cat "$f"; }
  done
} > "$OUT/fp8_kv_${part}.md" 2>&1
cat "$OUT/fp8_kv_${part}.md"
