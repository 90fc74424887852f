#!/usr/bin/env bash
# Issue 25: TokenWeave's SHARDED residual (the default since 2026-11-27; TokenWeave sec. 3-4: each rank keeps only its
# 1/TP of each split's residual rows, the fused AR+add+RMSNorm gathers only the normed rows) vs the full residual
# (--tokenweave-full-residual), TP4 (4 GPUs, one rank per GPU), budget 150 s incl. the libtwcomm build (~25 s):
#  1. correctness first: test/gpu/test_tokenweave_gpu.py::test_tokenweave_tp2_one_rank_per_gpu_sharded_residual
#     [llama_bias_untied] (2 ranks on 2 GPUs, every token cut of prefill / mixed / decode steps, every rank's
#     non-owned residual rows NaN-filled after each sharded call, bf16 logits vs the fp32 reference)
#  2. scripts/gpu/issue25_tw_4gpu.sh (it builds libtwcomm) with TW_EXTRA_VARIANTS=tokenweave_full: benchmark/tokenweave/bench_layer.py,
#     Llama-3.3-70B config cut to 4 layers, TP4, dummy bf16, T = 1024 2048 4096 8192, variants nccl nccl_symm nocomm
#     tokenweave (sharded residual) tokenweave_full, same run and seeded weights, eager + every forward CUDA-graphed;
#     ratios tokenweave / nccl, tokenweave_full / nccl, tokenweave / tokenweave_full (sharded / full); the correctness
#     section has every variant's eager next-token logits vs nccl's (full should equal tokenweave's);
#     --overlap-tokens 4096: the comm kernels' busy time per forward (sharded moves ~1/3 fewer bytes: kernel 803.7 vs
#     1142.1 us at T=8K, benchmark/results/comm/2026-11-27_twoshot_bulk_kernel_4xh200.md).
#     First run (at 40076df, variants tokenweave = full and tokenweave_sharded, before the default changed):
#     benchmark/results/tokenweave/2026-11-27_sharded_residual_and_e2e_4xh200.md.
# Tables: $OUT/issue25_shard.md. Usage (repo root): bash scripts/gpu/issue25_shard_4gpu.sh [seconds, default 150]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-150}"; start=$SECONDS
out="${OUT:-/tmp/issue25_shard}"; mkdir -p "$out"
echo "== 1. TokenWeave executor TP2, sharded residual, stale rows poisoned, vs the fp32 reference"
timeout --kill-after=5 60 "$PY" -m pytest -q -x \
  "test/gpu/test_tokenweave_gpu.py::test_tokenweave_tp2_one_rank_per_gpu_sharded_residual[llama_bias_untied]" \
  -p no:cacheprovider > "$out/issue25_shard_gpu_test.log" 2>&1
echo "tokenweave_tp2_sharded_gpu_test: rc=$? ($(( SECONDS - start )) s)"; tail -3 "$out/issue25_shard_gpu_test.log"

echo "== 2. TP4 layer benchmark with tokenweave (sharded) beside tokenweave_full, nccl, nccl_symm, nocomm"
left=$(( budget - (SECONDS - start) ))
OUT="$out" TW_EXTRA_VARIANTS="tokenweave_full" TW_RESULT=issue25_shard.md TW_SKIP_TP2_TEST=1 TW_BENCH_S=$(( left - 35 )) \
  bash "$(dirname "$0")/issue25_tw_4gpu.sh" "$left"
echo "== issue25_shard done ($(( SECONDS - start )) s of $budget s)"
grep -E "tokenweave_full|^- T=" "$out/issue25_shard.md" 2>/dev/null | head -12
