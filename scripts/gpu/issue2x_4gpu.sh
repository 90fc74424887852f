#!/usr/bin/env bash
# The world-4 rows of issues 24 (M2N), 25 (tw-comm, TokenWeave) and 26 (tdist) in one call on 4 GPUs (one rank per
# GPU), <= 560 s with the JIT builds. Correctness first, then the benchmarks; every step has its own limit and the
# script always reaches its summary.
#   1. build libtwcomm (nvcc, sm_90a)
#   2. tw-comm GPU tests at world 4 (every variant + the Lamport one-shot vs the torch reference, quick mode)
#   3. M2N one rank per GPU at world 4: cuda_ipc, inline, cuda_push (bytes vs torch reference, 10k messages,
#      killed peer fails closed)
#   4. benchmark/tokenweave/bench_layer.py, Llama-3.3-70B config, TP4, 4 layers, T = 1024 2048 4096 8192:
#      nccl / nccl_symm / nocomm / tokenweave (+ overlap profile at 4096)
#   5. benchmark/comm/bench_allreduce_rmsnorm.py --worlds 4 (T = 1 .. 16384, NCCL + fused norm, NCCL symmetric, torch
#      symm-mem, every tw-comm variant incl. Lamport)
#   6. benchmark/tdist/bench_kernels.py --world 4, Llama-3.3-70B TP4 shapes, M = 2048 / 8192 (+ all-to-all 1024 x 7168, graphs)
# Output: $OUT/issue2x_4gpu.md (every table) + one log per step. Usage: bash scripts/gpu/issue2x_4gpu.sh [budget s]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
export TRITON_DEFAULT_FP_FUSION=1
. "$root/scripts/gpu/lib_budget.sh"  # budget_start, left, step (run with a limit, keep the log, record the exit code)
budget_start "${1:-560}"
out="${OUT:-/tmp/issue2x_4gpu}"; mkdir -p "$out"
step_item="- " step_reserve=3 step_kill=5
step_show() { grep -E "passed|failed|skipped|^\| |Error|\[partial\]|\[tw-comm gpu\]" "$1" | tail -40; }
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
ngpu="$(nvidia-smi -L 2>/dev/null | wc -l)"
echo "$ngpu x $gpu"; nvidia-smi topo -m 2>/dev/null | head -6
m70=../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct

step build 90 "$PY" -c "from sgl_kernel.tw_comm.build import build_library; print(build_library())"
TW_COMM_QUICK=1 step tw_comm_test 60 "$PY" -m pytest -q -p no:cacheprovider \
  "test/gpu/test_tw_comm_gpu.py::test_tw_comm_gpu[4]" "test/gpu/test_tw_comm_gpu.py::test_tw_comm_lamport_gpu[4]"
step m2n_test 110 "$PY" -m pytest -q -p no:cacheprovider -k "4gpu" test/gpu/test_m2n_multi_gpu.py
mkdir -p "$out/layer"
step tokenweave_tp4 110 "$PY" benchmark/tokenweave/bench_layer.py --tp 4 --layers 4 --model-path "$m70" \
  --tokens 1024 2048 4096 8192 --variants nccl nccl_symm nocomm tokenweave --iters 5 --warmup 5 \
  --overlap-tokens 4096 --results-dir "$out/layer" --profile-dir "$out/layer" --timeout 105
step ar_rmsnorm_w4 80 "$PY" benchmark/comm/bench_allreduce_rmsnorm.py --worlds 4 --lamport \
  --calls-per-graph 5 --replays 5 --out "$out" --tag _w4
step tdist_w4 100 "$PY" benchmark/tdist/bench_kernels.py --world 4 --tp-shapes 4 --tokens 2048 8192 \
  --a2a-tokens 1024 --a2a-hidden 7168 --iters 20 --variants decomp auto graph --results-dir "$out" --timeout 95
for f in "$out"/*_tdist.md; do [ -f "$f" ] && mv "$f" "$out/issue26_bench_w4.md"; done
[ -f "$out/issue26_bench_w4.md" ] && "$PY" benchmark/tdist/targets_status.py "$out/issue26_bench_w4.md" \
  "$out/issue26_status_w4.md" > /dev/null 2>&1

res="$out/issue2x_4gpu.md"
{
  echo "# World-4 rows of issues 24/25/26 on $ngpu x $gpu ($(date -u +%Y-%m-%dT%H:%MZ)); \`bash scripts/gpu/issue2x_4gpu.sh $budget\`"
  echo "- NVLink multicast off in every process (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1)"
  echo; echo "## tests"; grep -hE "passed|failed|skipped" "$out"/tw_comm_test.log "$out"/m2n_test.log 2>/dev/null | tail -6
  echo; echo "## TokenWeave TP4"; cat "$out"/layer/*_tokenweave_layer.md 2>/dev/null || echo "(none; see tokenweave_tp4.log)"
  echo; echo "## fused AllReduce + RMSNorm, world 4"; cat "$out"/tw_comm_allreduce_rmsnorm_*_w4.md 2>/dev/null || echo "(none)"
  echo; echo "## tdist world 4"; cat "$out/issue26_bench_w4.md" 2>/dev/null || echo "(none)"
  echo; echo "## tdist status"; cat "$out/issue26_status_w4.md" 2>/dev/null || echo "(none)"
  echo; echo "## steps"; printf '%s\n' "${summary[@]}"
} > "$res"
echo "== summary (budget ${budget} s, used $(( SECONDS - start )) s; $ngpu x $gpu)"; printf '%s\n' "${summary[@]}"
