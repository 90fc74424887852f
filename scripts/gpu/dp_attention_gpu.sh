#!/usr/bin/env bash
# DP attention on 1 or 2 GPUs, each step bounded:
#   bash scripts/gpu/dp_attention_gpu.sh [budget_s, default 420]      (DRY_RUN=1: print the commands only)
# 1. the CPU-side DP-attention unit tests that touch CUDA-free logic (plan, router, step agreement, runner branches);
# 2. one GPU: both DP ranks on it (--tp-ranks-share-gpu, gloo, no graphs): TP1's tokens through the GPU kernels;
# 3. two GPUs (skipped on one): test/gpu/test_dp_attention_gpu.py: a --tp 2 --dp-size 2 --ep-size 2
#    --enable-dp-attention server on stories260K-moe8 (fp32) with decode CUDA graphs gives TP1's greedy tokens
#    (batch, one request with the other rank idle, requests joining mid-decode); again with --moe-a2a-backend nccl,
#    and with nccl + --enable-two-batch-overlap --tbo-min-tokens 2 (graphs capture the two-stream schedule).
# Writes $OUT/dp_attention_gpu.md (one line per step) and one log per step.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"
out="${OUT:-/tmp/dp_attention_gpu}"; mkdir -p "$out"
start_run "$out/run.log" "${1:-420}"
step_dry=${DRY_RUN:-}
pyt=("$PY" -m pytest -q -x -p no:cacheprovider -rA)
summary=()
stage "units"
step units 60 "${pyt[@]}" test/unit/test_dp_attention_plan.py test/unit/test_dp_attention_runner.py
stage "DP2 ranks sharing one GPU"
step dp2_shared_gpu 120 "${pyt[@]}" test/gpu/test_dp_attention_gpu.py::test_dp2_ranks_sharing_one_gpu_equal_tp1
stage "DP2 server, CUDA graphs, all-gather EP"
step dp2_graphs 150 "${pyt[@]}" "test/gpu/test_dp_attention_gpu.py::test_dp2_server_with_cuda_graphs_equals_tp1[none]"
stage "DP2 server, CUDA graphs, nccl all-to-all"
step dp2_graphs_a2a 150 "${pyt[@]}" "test/gpu/test_dp_attention_gpu.py::test_dp2_server_with_cuda_graphs_equals_tp1[nccl]"
stage "DP2 server, CUDA graphs, nccl all-to-all, forced two-batch overlap"
step dp2_graphs_a2a_tbo 150 "${pyt[@]}" "test/gpu/test_dp_attention_gpu.py::test_dp2_server_with_cuda_graphs_equals_tp1[nccl-tbo]"
{
  echo "# DP attention on GPU ($(date -u +%FT%TZ), commit ${commit:-$(commit_id)}, ${gpu:-$(gpu_name)} x $(nvidia-smi -L 2>/dev/null | wc -l))"
  printf -- '- %s\n' "${summary[@]}"
  echo "- total $(elapsed) s"
} | tee "$out/dp_attention_gpu.md"
