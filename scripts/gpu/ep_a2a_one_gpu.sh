#!/usr/bin/env bash
# Expert parallelism by all-to-all (--moe-a2a-backend nccl|tdist) on ONE GPU, one device call of <= 6 minutes:
#   1. dispatcher  test/gpu/test_token_dispatcher_gpu.py -k "world1 or share_one_gpu": dispatch -> Triton fused MoE
#                  -> combine vs the torch reference on fresh random bf16 inputs, both backends, both modes, the
#                  all-to-alls on a side stream, the low-latency path captured in a CUDA graph and replayed (world 1),
#                  and tdist at world 2 with both ranks sharing the GPU (CUDA IPC);
#   2. server      test_ep2_share_gpu_server_greedy_equals_tp1: TP1 server vs --tp 2 --ep-size 2
#                  --tp-ranks-share-gpu with each backend on stories260K-moe8, 32 greedy tokens for 4 prompts.
# Every step has a limit and runs even when an earlier one failed; $OUT/ep_a2a_summary.txt lists each step's exit
# code (124 = hit its limit) and the logs sit beside it. DRY_RUN=1 prints the steps without running them.
# Usage (repo root; shared data at ../shared/data or carried as .sd/): bash scripts/gpu/ep_a2a_one_gpu.sh [seconds]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"
budget_start "${1:-360}"
out="${OUT:-/tmp/ep_a2a_gpu_logs}"; mkdir -p "$out"
step_prefix=ep_a2a_
step_dry=${DRY_RUN:-}
{
  echo "== environment ($(commit_id))"
  [ -n "$step_dry" ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3
  [ -n "$step_dry" ] || "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" 2>&1
  env | grep -E "NVLS|MULTICAST" | sort
} | tee "$out/ep_a2a_summary.txt"
step dispatcher 150 "$PY" -m pytest -v -rA -p no:cacheprovider test/gpu/test_token_dispatcher_gpu.py \
  -k "world1 or share_one_gpu"
step server "$(cap 200)" "$PY" -m pytest -v -rA -p no:cacheprovider test/gpu/test_token_dispatcher_gpu.py \
  -k share_gpu_server
echo; echo "== summary (logs in $out)"
printf '%s\n' "${summary[@]}" | tee -a "$out/ep_a2a_summary.txt"
