#!/usr/bin/env bash
# Issue 25, round 1 on 2 H100s (budget 150 s incl. compile): correctness first, then the benchmarks.
#  1. build libtwcomm (nvcc, sm_90a; cached by content hash)
#  2. tw-comm GPU test at world 2 (quick: every variant vs the torch reference on fresh random inputs, graph replay,
#     back-to-back calls); 2b. TokenWeave's executor (two streams, per-split final norm, one embedding) with 2 TP
#     ranks on one GPU vs the fp32 single-process reference at every cut
#  3. nccl_symm self-check: the symmetric window registers (register_mem_pool(pool, True)) and its all-reduce
#     equals plain NCCL; NCCL_DEBUG=INFO lines naming [Symmetric] are counted (proof the symmetric kernels ran)
#  4. bench_tw_comm_allreduce_rmsnorm.py: world 2, hidden 8192 bf16, T = 1 32 128 1024 8192; NCCL + fused norm,
#     nccl_symm + fused norm, torch symm-mem + fused norm, tw-comm oneshot / twoshot / twoshot_sharded / ce
#  5. bench_tokenweave.py: Llama-3.3-70B config, TP2, 4 layers, T = 1024 2048 4096 8192; nocomm / nccl /
#     nccl_symm / tokenweave (all with the same fused add-RMSNorm kernel), 5 warm-ups, CUDA-event medians, and a
#     torch-profiler summary (top ops by CUDA and host time) of one TokenWeave forward at 1024 tokens
# Tables go to $OUT/issue25_*.md. Usage (repo root): bash scripts/gpu/issue25_2gpu.sh [seconds, default 150]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-150}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
cap() { local want=$1 l; l=$(( $(left) - 2 )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }
out="${OUT:-/tmp/issue25}"; mkdir -p "$out"
summary=()
step() { summary+=("$1: $2 ($(( SECONDS - start )) s)"); echo "-- $1: $2"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | head -2

echo "== 1. build libtwcomm"
timeout "$(cap 100)" "$PY" -c "from sgl_kernel.tw_comm_build import build_library; print(build_library())" \
  > "$out/issue25_build.log" 2>&1
rc=$?; tail -2 "$out/issue25_build.log"; step build "rc=$rc"

echo "== 2. tw-comm GPU correctness, world 2 (vs torch reference)"
TW_COMM_QUICK=1 timeout "$(cap 30)" "$PY" -m pytest -q -x "test/gpu/test_tw_comm_gpu.py::test_tw_comm_gpu[2]" \
  -p no:cacheprovider > "$out/issue25_tw_comm_gpu_test.log" 2>&1
rc=$?; tail -3 "$out/issue25_tw_comm_gpu_test.log"; step tw_comm_gpu_test "rc=$rc"

echo "== 2b. TokenWeave executor on GPU (2 TP ranks, tw-comm + two streams, per-split final norm) vs fp32 reference"
timeout "$(cap 40)" "$PY" -m pytest -q -x \
  "test/gpu/test_tokenweave_gpu.py::test_tokenweave_tp_ranks_share_one_gpu[llama_bias_untied-2]" \
  -p no:cacheprovider > "$out/issue25_tokenweave_gpu_test.log" 2>&1
rc=$?; tail -3 "$out/issue25_tokenweave_gpu_test.log"; step tokenweave_executor_gpu_test "rc=$rc"

echo "== 3. nccl_symm self-check (window registration + equality with plain NCCL)"
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL,TUNING timeout "$(cap 25)" "$PY" benchmark/nccl_symm.py 2 \
  > "$out/issue25_nccl_symm_check.log" 2>&1
rc=$?; nsym=$(grep -c "Symmetric" "$out/issue25_nccl_symm_check.log")
grep -m2 "Symmetric" "$out/issue25_nccl_symm_check.log" | cut -c1-200; grep "self-check" "$out/issue25_nccl_symm_check.log"
step nccl_symm_check "rc=$rc, $nsym NCCL log lines name [Symmetric]"

echo "== 4. fused AllReduce + RMSNorm, world 2, hidden 8192 bf16"
timeout "$(cap 40)" "$PY" benchmark/bench_tw_comm_allreduce_rmsnorm.py --worlds 2 --tokens 1,32,128,1024,8192 \
  --sweep-min-tokens 100000000 --calls-per-graph 10 --replays 5 --out "$out" --tag _issue25 \
  > "$out/issue25_ar_rmsnorm.log" 2>&1
rc=$?; grep -E "^\|" "$out/issue25_ar_rmsnorm.log"; grep -E "^- " "$out/issue25_ar_rmsnorm.log" | head -5
cp "$out"/tw_comm_allreduce_rmsnorm_*_issue25.md "$out/issue25_ar_rmsnorm.md" 2>/dev/null
step ar_rmsnorm_bench "rc=$rc"

echo "== 5. TokenWeave layer benchmark, Llama-3.3-70B TP2, 4 layers"
timeout "$(cap 300)" "$PY" benchmark/bench_tokenweave.py --tp 2 --layers 4 \
  --model-path ../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct --tokens 1024 2048 4096 8192 \
  --variants nccl tokenweave nccl_symm nocomm --iters 5 --warmup 5 --profile-tokens 1024 \
  --results-dir "$out" --profile-dir "$out" --timeout 200 > "$out/issue25_tokenweave.log" 2>&1
rc=$?; grep -E "^\||^- (note|timing)" "$out/issue25_tokenweave.log" || grep "\[partial\]" "$out/issue25_tokenweave.log"
cp "$out"/*_tokenweave_layer.md "$out/issue25_tokenweave_layer.md" 2>/dev/null
if [ -f "$out/tokenweave_profile_T1024.txt" ]; then
  echo "-- profile of one TokenWeave forward at 1024 tokens (top 12 by CUDA time, top 12 by host time)"
  awk '/^## /{n=0; print; next} {n++; if (n<=15) print}' "$out/tokenweave_profile_T1024.txt" | cut -c1-150
fi
step tokenweave_layer_bench "rc=$rc"
[ "$rc" -ne 0 ] && grep -E "Error|error" "$out/issue25_tokenweave.log" | tail -5

echo "== summary (budget ${budget} s, used $(( SECONDS - start )) s)"
printf '%s\n' "${summary[@]}" | tee "$out/issue25_summary.md"
