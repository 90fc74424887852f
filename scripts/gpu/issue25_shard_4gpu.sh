#!/usr/bin/env bash
# Issue 25: TokenWeave with the SHARDED residual (--tokenweave-sharded-residual, opt-in; TokenWeave sec. 3-4: each rank
# keeps only its 1/TP of each split's residual rows, the fused AR+add+RMSNorm gathers only the normed rows) vs the
# full residual, TP4 (4 GPUs, one rank per GPU), budget 150 s incl. the libtwcomm build (~25 s):
#  1. build libtwcomm (nvcc, sm_90a; cached by content hash)
#  2. correctness first: test/gpu/test_tokenweave_gpu.py::test_tokenweave_tp2_one_rank_per_gpu_sharded_residual
#     [llama_bias_untied] (2 ranks on 2 GPUs, every token cut of prefill / mixed / decode steps, every rank's
#     non-owned residual rows NaN-filled after each sharded call, bf16 logits vs the fp32 reference)
#  3. bench_tokenweave.py, Llama-3.3-70B config cut to 4 layers, TP4, dummy bf16, T = 1024 2048 4096 8192, variants
#     nccl nocomm tokenweave tokenweave_sharded, same run and seeded weights, eager + every forward CUDA-graphed;
#     ratios tokenweave / nccl, tokenweave_sharded / nccl, tokenweave_sharded / tokenweave; the correctness section
#     has every variant's eager next-token logits vs nccl's (sharded should equal tokenweave's); --overlap-tokens 4096:
#     the comm kernels' busy time per forward (sharded moves ~1/3 fewer bytes: kernel 803.7 vs 1142.1 us at T=8K,
#     benchmark/results/2026-11-27_issue25_kern_4xh200.md).
# Tables: $OUT/issue25_shard.md. Usage (repo root): bash scripts/gpu/issue25_shard_4gpu.sh [seconds, default 150]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-150}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
cap() { local want=$1 l; l=$(( $(left) - 2 )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }
out="${OUT:-/tmp/issue25_shard}"; mkdir -p "$out"
result="$out/issue25_shard.md"
summary=()
step() { summary+=("$1: $2 ($(( SECONDS - start )) s)"); echo "-- $1: $2"; }
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
ngpu="$(nvidia-smi -L 2>/dev/null | wc -l)"
echo "$ngpu x $gpu, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
m70=../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct

echo "== 1. build libtwcomm"
timeout --kill-after=5 "$(cap 45)" "$PY" -c "from sgl_kernel.tw_comm.build import build_library; print(build_library())" \
  > "$out/issue25_shard_build.log" 2>&1
rc=$?; tail -2 "$out/issue25_shard_build.log"; step build "rc=$rc"

echo "== 2. TokenWeave executor TP2, sharded residual, stale rows poisoned, vs the fp32 reference"
timeout --kill-after=5 "$(cap 35)" "$PY" -m pytest -q -x \
  "test/gpu/test_tokenweave_gpu.py::test_tokenweave_tp2_one_rank_per_gpu_sharded_residual[llama_bias_untied]" \
  -p no:cacheprovider > "$out/issue25_shard_gpu_test.log" 2>&1
rc=$?; tail -3 "$out/issue25_shard_gpu_test.log"; step tokenweave_tp2_sharded_gpu_test "rc=$rc"

echo "== 3. TP4 layer benchmark: nccl nocomm tokenweave tokenweave_sharded, eager + CUDA graph"
mkdir -p "$out/layer"
bench_s=$(cap $(( $(left) - 3 )))
timeout --kill-after=5 "$bench_s" "$PY" benchmark/bench_tokenweave.py --tp 4 --layers 4 --model-path "$m70" \
  --tokens 1024 2048 4096 8192 --variants nccl nocomm tokenweave tokenweave_sharded --iters 5 --warmup 5 \
  --cuda-graph --overlap-tokens 4096 --results-dir "$out/layer" --profile-dir "$out/layer" \
  --timeout $(( bench_s - 4 )) > "$out/issue25_shard_bench.log" 2>&1
rc=$?
cp "$out"/layer/*_tokenweave_layer.md "$result" 2>/dev/null \
  || { echo "no results file; partial rows:"; grep "\[partial\]" "$out/issue25_shard_bench.log" > "$result"; }
step tokenweave_sharded_tp4_bench "rc=$rc"
[ "$rc" -ne 0 ] && grep -E "Error|error|Timeout" "$out/issue25_shard_bench.log" | tail -5

echo "== summary ($ngpu x $gpu, budget $budget s, used $(( SECONDS - start )) s)"
printf '%s\n' "${summary[@]}"
grep -E "^\| meta|^- (T=|note|replay)|^\| tokenweave|^## " "$result" 2>/dev/null \
  || grep "\[partial\]" "$out/issue25_shard_bench.log"
