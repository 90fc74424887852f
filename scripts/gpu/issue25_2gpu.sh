#!/usr/bin/env bash
# Issue 25, round 2 on 2 H100s (budget 200 s incl. compile): correctness first, then the benchmarks.
#  1. build libtwcomm (nvcc, sm_90a; cached by content hash)
#  2. tw-comm GPU test at world 2 (quick: every variant vs the torch reference on fresh random inputs, graph replay,
#     back-to-back calls); 2b. TokenWeave's executor with 2 TP ranks on one GPU vs the fp32 single-process
#     reference at every cut (exercises this round's executor changes: reused per-split events, no per-stage
#     record_stream, held split outputs; and the eager tw-comm launch without the custom-op dispatcher)
#  2c. the Lamport one-shot (new: flag in the data, no barrier) alone: every shape vs the torch reference,
#     bit-identical ranks, negative zeros in x, graph replay, 2000+ back-to-back calls interleaved with one-shot
#  3. bench_tw_comm_allreduce_rmsnorm.py: world 2, hidden 8192 bf16, T = 1 32 128 1024 8192; NCCL + fused norm,
#     nccl_symm + fused norm, torch symm-mem + fused norm, tw-comm oneshot / lamport (only if 2c passed) /
#     twoshot / twoshot_sharded / ce
#  4. bench_tokenweave.py: Llama-3.3-70B config, TP2, 4 layers, T = 1024 2048 4096 8192; nocomm / nccl /
#     nccl_symm / tokenweave / split_nocomm (TokenWeave's split executor with no collectives: the split's own cost);
#     per variant GPU ms (CUDA events) vs host enqueue ms, kernel launches per forward (profiled at 1024 tokens,
#     nccl and tokenweave), the auto-off decision per T, and a torch-profiler summary of one TokenWeave forward
#  5. comm-CTA sweep: tokenweave vs nccl at T = 1024 2048 4096 with --comm-sms 32 and 64 (default 16)
#  6. $OUT/2026-11-26_issue25_round2_2xh100.md: every table above with date, GPU, commit, commands
# Tables go to $OUT/issue25_*.md. Usage (repo root): bash scripts/gpu/issue25_2gpu.sh [seconds, default 200]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-200}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
cap() { local want=$1 l; l=$(( $(left) - 2 )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }
out="${OUT:-/tmp/issue25}"; mkdir -p "$out"
summary=()
step() { summary+=("$1: $2 ($(( SECONDS - start )) s)"); echo "-- $1: $2"; }
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
ngpu="$(nvidia-smi -L 2>/dev/null | wc -l)"
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "$ngpu x $gpu, commit $commit"
m70=../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct

echo "== 1. build libtwcomm"
timeout "$(cap 100)" "$PY" -c "from sgl_kernel.tw_comm.build import build_library; print(build_library())" \
  > "$out/issue25_build.log" 2>&1
rc=$?; tail -2 "$out/issue25_build.log"; step build "rc=$rc"

echo "== 2. tw-comm GPU correctness, world 2 (vs torch reference)"
TW_COMM_QUICK=1 timeout "$(cap 35)" "$PY" -m pytest -q -x "test/gpu/test_tw_comm_gpu.py::test_tw_comm_gpu[2]" \
  -p no:cacheprovider > "$out/issue25_tw_comm_gpu_test.log" 2>&1
rc=$?; tail -3 "$out/issue25_tw_comm_gpu_test.log"; step tw_comm_gpu_test "rc=$rc"

echo "== 2b. TokenWeave executor on GPU (2 TP ranks, tw-comm + two streams, per-split final norm) vs fp32 reference"
timeout "$(cap 45)" "$PY" -m pytest -q -x \
  "test/gpu/test_tokenweave_gpu.py::test_tokenweave_tp_ranks_share_one_gpu[llama_bias_untied-2]" \
  -p no:cacheprovider > "$out/issue25_tokenweave_gpu_test.log" 2>&1
rc=$?; tail -3 "$out/issue25_tokenweave_gpu_test.log"; step tokenweave_executor_gpu_test "rc=$rc"

echo "== 2c. Lamport one-shot (flag in the data) GPU correctness, world 2 (vs torch reference, graphs, back-to-back)"
TW_COMM_QUICK=1 timeout "$(cap 40)" "$PY" -m pytest -q -x "test/gpu/test_tw_comm_gpu.py::test_tw_comm_lamport_gpu[2]" \
  -p no:cacheprovider > "$out/issue25_lamport_gpu_test.log" 2>&1
lamport_rc=$?; tail -3 "$out/issue25_lamport_gpu_test.log"; step lamport_gpu_test "rc=$lamport_rc"
lamport_flag=(); [ "$lamport_rc" -eq 0 ] && lamport_flag=(--lamport)  # a hanging kernel must not cost the table

echo "== 3. fused AllReduce + RMSNorm, world 2, hidden 8192 bf16"
timeout "$(cap 40)" "$PY" benchmark/bench_tw_comm_allreduce_rmsnorm.py --worlds 2 --tokens 1,32,128,1024,8192 \
  --sweep-min-tokens 100000000 --calls-per-graph 10 --replays 5 --out "$out" --tag _issue25 "${lamport_flag[@]}" \
  > "$out/issue25_ar_rmsnorm.log" 2>&1
rc=$?; grep -E "^\|" "$out/issue25_ar_rmsnorm.log"; grep -E "^- " "$out/issue25_ar_rmsnorm.log" | head -5
cp "$out"/tw_comm_allreduce_rmsnorm_*_issue25.md "$out/issue25_ar_rmsnorm.md" 2>/dev/null
step ar_rmsnorm_bench "rc=$rc"

echo "== 4. TokenWeave layer benchmark, Llama-3.3-70B TP2, 4 layers (GPU vs host time, auto-off per T)"
mkdir -p "$out/layer"
timeout "$(cap 60)" "$PY" benchmark/bench_tokenweave.py --tp 2 --layers 4 --model-path "$m70" \
  --tokens 1024 2048 4096 8192 --variants nccl tokenweave nccl_symm nocomm split_nocomm --iters 5 --warmup 5 \
  --profile-tokens 1024 --results-dir "$out/layer" --profile-dir "$out" --timeout 55 > "$out/issue25_tokenweave.log" 2>&1
rc=$?; grep -E "^\||^- (note|timing|auto-off|supported|meta)|^## " "$out/issue25_tokenweave.log" \
  || grep "\[partial\]" "$out/issue25_tokenweave.log"
cp "$out"/layer/*_tokenweave_layer.md "$out/issue25_tokenweave_layer.md" 2>/dev/null
if [ -f "$out/tokenweave_profile_T1024.txt" ]; then
  echo "-- profile of one TokenWeave forward at 1024 tokens (top 10 by CUDA time, top 10 by host time)"
  awk '/^## /{n=0; print; next} {n++; if (n<=13) print}' "$out/tokenweave_profile_T1024.txt" | cut -c1-150
fi
step tokenweave_layer_bench "rc=$rc"
[ "$rc" -ne 0 ] && grep -E "Error|error" "$out/issue25_tokenweave.log" | tail -5

echo "== 5. comm-CTA sweep: tokenweave vs nccl, --comm-sms 32 / 64"
for sms in 32 64; do
  [ "$(left)" -lt 25 ] && { step "comm_sms_$sms" "skipped (budget)"; continue; }
  mkdir -p "$out/sms$sms"
  timeout "$(cap 40)" "$PY" benchmark/bench_tokenweave.py --tp 2 --layers 4 --model-path "$m70" \
    --tokens 1024 2048 4096 --variants nccl tokenweave --iters 5 --warmup 5 --comm-sms "$sms" \
    --results-dir "$out/sms$sms" --timeout 35 > "$out/issue25_tokenweave_sms$sms.log" 2>&1
  rc=$?; grep -E "^\| meta" "$out/issue25_tokenweave_sms$sms.log" | head -3 || grep "\[partial\]" "$out/issue25_tokenweave_sms$sms.log"
  cp "$out"/sms$sms/*_tokenweave_layer.md "$out/issue25_tokenweave_layer_sms$sms.md" 2>/dev/null
  step "comm_sms_$sms" "rc=$rc"
done

echo "== 6. results file"
res="$out/2026-11-26_issue25_round2_2xh100.md"
{
  echo "# Issue 25 round 2: tw-comm fused AllReduce+RMSNorm and TokenWeave on $ngpu x $gpu"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ); commit: $commit; command: \`bash scripts/gpu/issue25_2gpu.sh $budget\`"
  echo "- NVLink multicast off in every process (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1)"
  echo; echo "## Fused AllReduce + RMSNorm, world 2, hidden 8192 bf16 (us per call, CUDA-graph replay)"; echo
  grep -vE "^# " "$out/issue25_ar_rmsnorm.md" 2>/dev/null || echo "(not measured: see issue25_ar_rmsnorm.log)"
  echo; echo "## TokenWeave, Llama-3.3-70B TP2, 4 layers (ms per forward)"; echo
  grep -vE "^# " "$out/issue25_tokenweave_layer.md" 2>/dev/null || echo "(not measured: see issue25_tokenweave.log)"
  for sms in 32 64; do
    echo; echo "## TokenWeave with --comm-sms $sms (default 16)"; echo
    grep -E "^\||^- timing" "$out/issue25_tokenweave_layer_sms$sms.md" 2>/dev/null || echo "(not measured)"
  done
  echo; echo "## Steps"; echo; printf -- '- %s\n' "${summary[@]}"
} > "$res"
step results_file "$(basename "$res")"

echo "== summary (budget ${budget} s, used $(( SECONDS - start )) s)"
printf '%s\n' "${summary[@]}" | tee "$out/issue25_summary.md"
