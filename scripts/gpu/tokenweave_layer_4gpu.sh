#!/usr/bin/env bash
# TokenWeave layer benchmark at TP4 (4 GPUs, one rank per GPU), budget 100 s incl. the libtwcomm build (~25 s):
#  1. build libtwcomm (nvcc, sm_90a; cached by content hash)
#  2. benchmark/tokenweave/bench_layer.py, Llama-3.3-70B config cut to 4 layers, TP4, dummy bf16, T = 1024 2048 4096 8192:
#     nccl / nccl_symm / nocomm / tokenweave, eager (GPU and host ms per forward) AND each forward captured as one
#     CUDA graph per (variant, T) and replayed (--cuda-graph: every variant graphed the same way); correctness in
#     the same run: TokenWeave's eager next-token logits vs the nccl variant's (same seeded weights) and every
#     graph's logits vs its eager forward; --host-profile 1024: cProfile of rank 0 over one eager forward per
#     variant (top 25 cumulative + top 15 own time), to show where the host time goes; --overlap-tokens 4096: one
#     torch-profiled eager forward per variant, how much of the communication kernels' time ran beside compute
#  3. (time left) the TokenWeave executor TP2 test, one rank per GPU, every cut vs the fp32 reference: checks the
#     changed output path (per-split final norms written into one preallocated buffer, set_stream per stage)
# Tables: $OUT/tokenweave_tp4.md. Usage (repo root): bash scripts/gpu/tokenweave_layer_4gpu.sh [seconds, default 100]
# Knobs (env): TW_EXTRA_VARIANTS="tokenweave_oldcomm" adds bench_tokenweave variants to the same run (e.g. TokenWeave
# on the pre-bulk comm beside the default one); TW_RESULT=name.md names the
# table file under $OUT; TW_BENCH_S caps step 2 (default 62 s); TW_SKIP_TP2_TEST=1 skips step 3; TW_OVERLAP_TOKENS
# (default "4096") the T list of --overlap-tokens. TW_LAYERS (default "4"): decoder layer counts, e.g. "1 4": the
# largest runs step 2 as above (result table, profiles); each other count then runs the same variants / T / graphs
# without the profiles (cap TW_FIT_BENCH_S each, default 45 s) into $out/layer_L<N>, and
# benchmark/tokenweave/layer_report.py --layer-fit appends the fixed per-forward cost (intercept ms) and per-layer cost
# (slope) per variant, T and mode (eager / graph / host) to the result table (target: fixed cost < 0.2 ms).
# "1 4" needs about 50 s more budget (e.g. TW_LAYERS="1 4" TW_SKIP_TP2_TEST=1 bash ... 160).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-100}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
cap() { local want=$1 l; l=$(( $(left) - 2 )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"; }
out="${OUT:-/tmp/tokenweave_layer}"; mkdir -p "$out"
result="$out/${TW_RESULT:-tokenweave_tp4.md}"
read -r -a extra_variants <<< "${TW_EXTRA_VARIANTS:-}"
summary=()
step() { summary+=("$1: $2 ($(( SECONDS - start )) s)"); echo "-- $1: $2"; }
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
ngpu="$(nvidia-smi -L 2>/dev/null | wc -l)"
echo "$ngpu x $gpu, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
m70=../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct

echo "== 1. build libtwcomm"
timeout --kill-after=5 "$(cap 45)" "$PY" -c "from sgl_kernel.tw_comm.build import build_library; print(build_library())" \
  > "$out/tw_build.log" 2>&1
rc=$?; tail -2 "$out/tw_build.log"; step build "rc=$rc"

read -r -a layer_counts <<< "${TW_LAYERS:-4}"
main_layers=$(printf '%s\n' "${layer_counts[@]}" | sort -n | tail -1)
echo "== 2. TokenWeave TP4 layer benchmark ($main_layers layers), eager + CUDA graph, host profile at 1024"
mkdir -p "$out/layer"
bench_s=$(cap "${TW_BENCH_S:-62}")
timeout --kill-after=5 "$bench_s" "$PY" benchmark/tokenweave/bench_layer.py --tp 4 --layers "$main_layers" --model-path "$m70" \
  --tokens 1024 2048 4096 8192 --variants nccl nccl_symm nocomm tokenweave ${extra_variants[@]+"${extra_variants[@]}"} \
  --iters 5 --warmup 5 \
  --cuda-graph --host-profile 1024 --overlap-tokens ${TW_OVERLAP_TOKENS:-4096} --results-dir "$out/layer" --profile-dir "$out/layer" \
  --timeout $(( bench_s - 4 )) > "$out/tw_bench.log" 2>&1
rc=$?
cp "$out"/layer/*_tokenweave_layer.md "$result" 2>/dev/null \
  || { echo "no results file; partial rows:"; grep "\[partial\]" "$out/tw_bench.log" > "$result"; }
step tokenweave_tp4_bench "rc=$rc"
[ "$rc" -ne 0 ] && grep -E "Error|error|Timeout" "$out/tw_bench.log" | tail -5

# 2b. the other layer counts (same variants, T, graphs; no profiles), then the fixed-cost fit over all counts
for n in "${layer_counts[@]}"; do
  [ "$n" = "$main_layers" ] && continue
  if [ "$(left)" -lt 25 ]; then step "tokenweave_tp4_L$n" "not run (no time left)"; continue; fi
  mkdir -p "$out/layer_L$n"; fit_s=$(cap "${TW_FIT_BENCH_S:-45}")
  timeout --kill-after=5 "$fit_s" "$PY" benchmark/tokenweave/bench_layer.py --tp 4 --layers "$n" --model-path "$m70" \
    --tokens 1024 2048 4096 8192 --variants nccl nccl_symm nocomm tokenweave \
    ${extra_variants[@]+"${extra_variants[@]}"} --iters 5 --warmup 5 --cuda-graph --results-dir "$out/layer_L$n" \
    --timeout $(( fit_s - 4 )) \
    > "$out/tw_bench_L$n.log" 2>&1
  rc=$?; step "tokenweave_tp4_L$n" "rc=$rc"
  [ "$rc" -ne 0 ] && grep -E "Error|error|Timeout" "$out/tw_bench_L$n.log" | tail -3
done
if [ "${#layer_counts[@]}" -gt 1 ]; then
  # shellcheck disable=SC2046
  timeout 30 "$PY" benchmark/tokenweave/layer_report.py --layer-fit $(ls "$out"/layer/*_tokenweave_layer*.json \
    "$out"/layer_L*/*_tokenweave_layer*.json 2>/dev/null) --out "$out/tw_layer_fit.md" \
    > "$out/tw_layer_fit.log" 2>&1
  rc=$?; step tokenweave_layer_fit "rc=$rc"
  { echo; cat "$out/tw_layer_fit.md" 2>/dev/null || tail -3 "$out/tw_layer_fit.log"; } >> "$result"
fi

echo "== 3. TokenWeave executor TP2 one rank per GPU vs fp32 reference (if time is left)"
if [ "${TW_SKIP_TP2_TEST:-0}" = 1 ]; then
  step tokenweave_tp2_gpu_test "skipped (TW_SKIP_TP2_TEST=1)"
elif [ "$(left)" -gt 20 ]; then
  timeout --kill-after=5 "$(cap 40)" "$PY" -m pytest -q -x \
    "test/gpu/test_tokenweave_gpu.py::test_tokenweave_tp2_one_rank_per_gpu[llama_bias_untied]" \
    -p no:cacheprovider > "$out/tw_gpu_test.log" 2>&1
  rc=$?; tail -3 "$out/tw_gpu_test.log"; step tokenweave_tp2_gpu_test "rc=$rc"
else
  step tokenweave_tp2_gpu_test "not run (no time left)"
fi

echo "== summary ($ngpu x $gpu, budget $budget s, used $(( SECONDS - start )) s)"
printf '%s\n' "${summary[@]}"
grep -E "^\| meta|^- (T=|note|replay)|^## |^host [0-9.]+ ms" "$result" 2>/dev/null \
  || grep "\[partial\]" "$out/tw_bench.log"
