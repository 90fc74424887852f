#!/usr/bin/env bash
# Issue 25, round 3 on 2 H100s (budget 150 s incl. the JIT build): correctness first, then the benchmarks.
# This round's change: during a TokenWeave split forward the cuBLAS GEMMs are capped to num_sms - comm CTAs
# (python/sglang/srt/tokenweave/carveout.py). Round 2 showed TokenWeave = 1.03x / 1.00x NCCL at 4096 / 8192
# tokens while the split itself cost nothing: persistent GEMMs held every SM, so the communication kernel of one
# split could not run beside the other split's GEMMs. The profile step (4) measures that overlap directly.
#  1. build libtwcomm (nvcc, sm_90a; cached by content hash)
#  2. tw-comm GPU test at world 2, one rank per GPU (quick: every variant vs the torch reference)
#  3. TokenWeave executor, TP2 with one rank per GPU (NCCL group, tw-comm over CUDA IPC, two streams, GEMM
#     carveout), every cut of prefill / mixed / decode steps vs the single-process fp32 reference
#  4. benchmark/tokenweave/bench_layer.py: Llama-3.3-70B config, TP2, 4 layers, T = 1024 2048 4096 8192; nccl / nccl_symm / nocomm
#     / tokenweave (carveout = 16 comm CTAs) / tokenweave_nocarve (round 2's behaviour) / split_nocomm (the split
#     with the carveout and no collectives); targets table with the no-communication bound; one profiled forward
#     per variant at 4096 tokens: communication time overlapped by compute kernels (+ rank 0 kernel timeline CSVs)
#  5. the same with --comm-sms 8 (8 comm CTAs, 8 SMs carved out) at 2048 4096 8192, overlap at 4096
#  6. fused AllReduce+RMSNorm, world 2: twoshot on 2..128 CTAs at T = 512..4096 (how long one split's comm
#     takes on the overlap budget), plus the usual baselines
# Tables: $OUT/issue25_*.md. Usage (repo root): bash scripts/gpu/issue25_2gpu.sh [seconds, default 150]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-150}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
cap() { local want=$1 l; l=$(( $(left) - 2 )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }
out="${OUT:-/tmp/issue25}"; mkdir -p "$out"
summary=()
step() { summary+=("$1: $2 ($(( SECONDS - start )) s)"); echo "-- $1: $2"; }
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
ngpu="$(nvidia-smi -L 2>/dev/null | wc -l)"
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "$ngpu x $gpu, commit $commit (may be stale on the device copy)"
m70=../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct

echo "== 1. build libtwcomm"
timeout "$(cap 60)" "$PY" -c "from sgl_kernel.tw_comm.build import build_library; print(build_library())" \
  > "$out/issue25_build.log" 2>&1
rc=$?; tail -2 "$out/issue25_build.log"; step build "rc=$rc"

echo "== 2. tw-comm GPU correctness, world 2, one rank per GPU (vs torch reference)"
TW_COMM_QUICK=1 timeout "$(cap 35)" "$PY" -m pytest -q -x "test/gpu/test_tw_comm_gpu.py::test_tw_comm_gpu[2]" \
  -p no:cacheprovider > "$out/issue25_tw_comm_gpu_test.log" 2>&1
rc=$?; tail -3 "$out/issue25_tw_comm_gpu_test.log"; step tw_comm_gpu_test "rc=$rc"

echo "== 3. TokenWeave executor TP2, one rank per GPU (two streams + GEMM carveout) vs fp32 reference"
timeout "$(cap 40)" "$PY" -m pytest -q -x \
  "test/gpu/test_tokenweave_gpu.py::test_tokenweave_tp2_one_rank_per_gpu[llama_bias_untied]" \
  -p no:cacheprovider > "$out/issue25_tokenweave_gpu_test.log" 2>&1
rc=$?; tail -3 "$out/issue25_tokenweave_gpu_test.log"; step tokenweave_executor_gpu_test "rc=$rc"

echo "== 4. TokenWeave layer benchmark, Llama-3.3-70B TP2, 4 layers (+ overlap profile at 4096)"
mkdir -p "$out/layer"
timeout "$(cap 55)" "$PY" benchmark/tokenweave/bench_layer.py --tp 2 --layers 4 --model-path "$m70" \
  --tokens 1024 2048 4096 8192 --variants nccl tokenweave tokenweave_nocarve nccl_symm nocomm split_nocomm \
  --iters 5 --warmup 5 --profile-tokens 1024 --overlap-tokens 4096 --results-dir "$out/layer" --profile-dir "$out" \
  --timeout 52 > "$out/issue25_tokenweave.log" 2>&1
rc=$?; grep -E "^\||^- (note|timing|auto-off|supported|meta)|^## " "$out/issue25_tokenweave.log" \
  || grep "\[partial\]" "$out/issue25_tokenweave.log"
cp "$out"/layer/*_tokenweave_layer.md "$out/issue25_tokenweave_layer.md" 2>/dev/null
step tokenweave_layer_bench "rc=$rc"
[ "$rc" -ne 0 ] && grep -E "Error|error" "$out/issue25_tokenweave.log" | tail -5

echo "== 5. --comm-sms 8 (8 comm CTAs, 8 SMs carved out of the GEMMs)"
if [ "$(left)" -lt 22 ]; then step comm_sms_8 "skipped (budget)"; else
  mkdir -p "$out/sms8"
  timeout "$(cap 30)" "$PY" benchmark/tokenweave/bench_layer.py --tp 2 --layers 4 --model-path "$m70" \
    --tokens 2048 4096 8192 --variants nccl nocomm tokenweave --iters 5 --warmup 5 --comm-sms 8 \
    --overlap-tokens 4096 --results-dir "$out/sms8" --profile-dir "$out/sms8" --timeout 28 \
    > "$out/issue25_tokenweave_sms8.log" 2>&1
  rc=$?; grep -E "^\| (meta|tokenweave|nccl|nocomm)" "$out/issue25_tokenweave_sms8.log" \
    || grep "\[partial\]" "$out/issue25_tokenweave_sms8.log"
  cp "$out"/sms8/*_tokenweave_layer.md "$out/issue25_tokenweave_layer_sms8.md" 2>/dev/null
  step comm_sms_8 "rc=$rc"
fi

echo "== 6. fused AllReduce + RMSNorm, world 2: twoshot CTA sweep at split sizes"
if [ "$(left)" -lt 15 ]; then step ar_rmsnorm_sweep "skipped (budget)"; else
  timeout "$(cap 30)" "$PY" benchmark/comm/bench_allreduce_rmsnorm.py --worlds 2 --tokens 512,1024,2048,4096 \
    --sweep-min-tokens 512 --calls-per-graph 5 --replays 3 --out "$out" --tag _issue25 \
    > "$out/issue25_ar_rmsnorm.log" 2>&1
  rc=$?; grep -E "^\|" "$out/issue25_ar_rmsnorm.log"
  cp "$out"/tw_comm_allreduce_rmsnorm_*_issue25.md "$out/issue25_ar_rmsnorm.md" 2>/dev/null
  step ar_rmsnorm_sweep "rc=$rc"
fi

res="$out/issue25_round3.md"  # every table of this call in one file
{
  echo "# Issue 25 round 3 on $ngpu x $gpu ($(date -u +%Y-%m-%dT%H:%MZ)); \`bash scripts/gpu/issue25_2gpu.sh $budget\`"
  echo "- NVLink multicast off in every process (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1)"
  for f in issue25_tokenweave_layer.md issue25_tokenweave_layer_sms8.md issue25_ar_rmsnorm.md; do
    echo; echo "## $f"; echo; cat "$out/$f" 2>/dev/null || echo "(not produced: see the step's log)"
  done
  echo; echo "## steps"; echo; printf -- '- %s\n' "${summary[@]}"
} > "$res"
echo "== summary (budget ${budget} s, used $(( SECONDS - start )) s; $ngpu x $gpu)"
printf '%s\n' "${summary[@]}" | tee "$out/issue25_summary.md"
