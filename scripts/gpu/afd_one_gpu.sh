#!/usr/bin/env bash
# MegaScale-Infer AFD on ONE GPU (issue 14): M2N CUDA-IPC and NIXL (VRAM READ over UCX; skips without the [pd]
# wheel) transports between two processes on the GPU vs a torch reference; an AFD server (1 attention + 2 FFN workers as separate processes on the one GPU) vs the colocated
# engine's greedy tokens; the bench_afd smoke (decode AFD vs colocated, M2N cuda_ipc vs NCCL send/recv latency;
# on one GPU the NCCL baseline needs two GPUs, so m2n mode runs only where torch.cuda.device_count() >= 2).
# Usage (repo root, shared data at ../shared/data): bash scripts/gpu/afd_one_gpu.sh [seconds, default 540]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"; budget_start "${1:-540}"  # left: seconds of it left
out="${OUT:-/tmp}"
echo "== AFD GPU tests (M2N cuda_ipc/inline/nixl vs reference; AFD server on one GPU)"
timeout $(( $(left) * 60 / 100 )) python3 -m pytest -q test/gpu/test_afd_gpu.py -p no:cacheprovider 2>&1 \
  | tee "$out/afd_gpu_tests.log" | tail -30
echo "== bench_afd decode (stories260K-moe, 1 attention + 2 FFN on this GPU vs colocated)"
timeout $(( $(left) * 50 / 100 )) python3 benchmark/afd/bench.py --mode decode --device cuda --batch 32 --steps 16 \
  --results-dir "$out" 2>&1 | tail -14
if python3 -c "import torch,sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)"; then
  echo "== bench_afd m2n (cuda_ipc vs NCCL send/recv, 32-512 KB)"
  timeout $(( $(left) - 10 )) python3 benchmark/afd/bench.py --mode m2n --device cuda --results-dir "$out" 2>&1 | tail -12
else
  echo "== bench_afd m2n skipped: NCCL send/recv needs two GPUs (one rank per GPU)"
fi
