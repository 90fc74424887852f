#!/usr/bin/env bash
# MegaScale-Infer AFD on ONE GPU: M2N CUDA-IPC and NIXL (VRAM READ over UCX; skips without the [pd] wheel) transports
# between two processes on the GPU vs a torch reference; an AFD server (1 attention + 2 FFN workers as separate
# processes on the one GPU) vs the colocated engine's greedy tokens; the bench_afd smoke (decode AFD vs colocated,
# M2N cuda_ipc vs NCCL send/recv latency; the NCCL baseline needs two GPUs, so m2n mode runs only where
# torch.cuda.device_count() >= 2).
# Usage (repo root, shared data at ../shared/data): bash scripts/gpu/afd_one_gpu.sh [seconds, default 540]
# DRY_RUN=1 prints the commands. Logs: $OUT/afd_*.log.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"; budget_start "${1:-540}"
out="${OUT:-/tmp}" step_prefix=afd_ step_dry=${DRY_RUN:-} step_tail=30
step gpu_tests $(( $(left) * 60 / 100 )) "$PY" -m pytest -q test/gpu/test_afd_gpu.py -p no:cacheprovider
step bench_decode $(( $(left) * 50 / 100 )) "$PY" benchmark/afd/bench.py --mode decode --device cuda --batch 32 \
  --steps 16 --results-dir "$out"
if "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)" 2>/dev/null; then
  step bench_m2n $(( $(left) - 10 )) "$PY" benchmark/afd/bench.py --mode m2n --device cuda --results-dir "$out"
else
  summary+=("bench_m2n: not run (NCCL send/recv needs two GPUs, one rank per GPU)")
fi
echo; printf '%s\n' "${summary[@]}"
