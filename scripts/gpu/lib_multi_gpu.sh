#!/usr/bin/env bash
# Step functions shared by two_gpu.sh and four_gpu.sh (sourced after device_preamble.sh; each function is exported,
# so a suite step's `bash -c` sees it). Each writes under $OUT (the step's folder) and returns non-zero on a failure.
#   tw_comm_tests W           libtwcomm build, then tw-comm's fused AllReduce + RMSNorm GPU tests at world W (quick:
#                             every variant, Lamport one-shot, pipelined and bulk two-shot vs the torch reference)
#   tw_comm_auto WORLDS       the communicator's automatic pick ("auto") vs the best full / sharded variant, NCCL +
#                             fused norm, NCCL symmetric and torch symmetric memory, worlds e.g. 4,2; --calibrate
#                             writes the crossover table $OUT/tw_comm_crossovers.json
#   tdist_auto W [M...]       bench_tdist.py at world W on the Llama-3.3-70B TP4 shapes (decomposition, its pieces,
#                             the auto op, graphs) vs NCCL + cuBLAS and torch symm-mem, then tdist_status.py's table
#   ep_serving N [dp]         Qwen3-30B-A3B (dummy bf16) served at EP N: all-reduce EP, all-to-all nccl / tdist, nccl
#                             + two-batch overlap; with dp: the same under --enable-dp-attention --dp-size N
#                             (serving_cases.sh: random 1024/128, 128/512, ShareGPT, 256 prompts each at once;
#                             EP_CASES="ep a2a_nccl" runs a subset, e.g. to split the step over two calls)
#   pd_saturated              PD (prefill GPU 0 -> decode GPU 1, NIXL) vs one aggregated server vs two replicas
#                             under saturating load: every request at once, random 1024/128 then ShareGPT, same call
export cfg=../shared/data/configs
export m70=$cfg/meta-llama--Llama-3.3-70B-Instruct m8b=$cfg/meta-llama--Meta-Llama-3.1-8B \
  qwen3=$cfg/Qwen--Qwen3-30B-A3B mixtral=$cfg/mistralai--Mixtral-8x7B-v0.1 tok=../shared/data/tokenizers/llama3 \
  tok_qwen=../shared/data/tokenizers/qwen2

build_twcomm() { timeout 90 "$PY" -c "from sgl_kernel.tw_comm.build import build_library; print(build_library())"; }
tw_comm_tests() {
  local w=$1 t=test/gpu/test_tw_comm_gpu.py
  build_twcomm || return 1
  TW_COMM_QUICK=1 "$PY" -m pytest -q -p no:cacheprovider "$t::test_tw_comm_gpu[$w]" "$t::test_tw_comm_lamport_gpu[$w]" \
    "$t::test_tw_comm_pipe_gpu[$w]" "$t::test_tw_comm_bulk_gpu[$w]"
}
tw_comm_auto() {
  build_twcomm || return 1
  "$PY" benchmark/comm/bench_allreduce_rmsnorm.py --worlds "$1" --lamport --no-ce --tokens 1,32,128,1024,8192 \
    --sweep-sms 16,32 --sweep-min-tokens 1024 --calibrate --calls-per-graph 3 --replays 3 --out "$OUT" \
    --table "$OUT/tw_comm_crossovers.json"
}
tdist_auto() {
  local w=$1 rc f toks; shift; toks=("$@"); (( ${#toks[@]} )) || toks=(2048 8192)
  "$PY" benchmark/tdist/bench_kernels.py --world "$w" --tp-shapes 4 --tokens "${toks[@]}" --a2a-tokens 1024 \
    --a2a-hidden 7168 --iters 20 --variants decomp pieces auto graph profile --results-dir "$OUT" \
    --timeout $(( B > 20 ? B - 10 : 10 ))
  rc=$?
  for f in "$OUT"/*_tdist.md; do
    [ -f "$f" ] && "$PY" benchmark/tdist/targets_status.py "$f" "$OUT/tdist_status_w$w.md" > /dev/null && cat "$OUT/tdist_status_w$w.md"
  done
  return $rc
}
ep_serving() {
  local n=$1 dp="" c=() x
  [ "${2:-}" = dp ] && dp=" --enable-dp-attention --dp-size $n"
  read -r -a c <<< "${EP_CASES:-ep a2a_nccl a2a_tdist a2a_nccl_tbo}"
  local specs=()
  for x in "${c[@]}"; do
    case $x in
      ep) specs+=("ep${dp:+_dp}|--tp $n --ep-size $n$dp") ;;
      a2a_nccl) specs+=("a2a_nccl${dp:+_dp}|--tp $n --ep-size $n --moe-a2a-backend nccl$dp") ;;
      a2a_tdist) specs+=("a2a_tdist${dp:+_dp}|--tp $n --ep-size $n --moe-a2a-backend tdist$dp") ;;
      a2a_nccl_tbo) specs+=("a2a_nccl_tbo${dp:+_dp}|--tp $n --ep-size $n --moe-a2a-backend nccl --enable-two-batch-overlap$dp") ;;
      *) echo "EP_CASES: unknown case '$x' (ep a2a_nccl a2a_tdist a2a_nccl_tbo)"; return 2 ;;
    esac
  done
  SERVING_WORKLOADS="${SERVING_WORKLOADS:-random:1024:128:256 random:128:512:256 sharegpt:256}" \
    bash scripts/gpu/serving_cases.sh "$qwen3" "$tok_qwen" "${specs[@]}"
}
pd_saturated() {
  local pids="$OUT/bench_pids" rc
  : > "$pids"
  "$PY" benchmark/disaggregation/bench_pd_serving.py --model-path "$m8b" --tokenizer-path "$tok" --device cuda \
    --transfer-backend nixl --transfer-mode pull --setups pd agg agg2 --prefill-extra "--base-gpu-id 0" \
    --decode-extra "--base-gpu-id 1" --agg-extra "--base-gpu-id 0" --replica-gpus 0 1 \
    --server-extra "--load-format dummy --dtype bfloat16 --max-total-tokens 131072" \
    --dataset random sharegpt --input-len 1024 --output-len 128 --num-prompts "${PD_PROMPTS:-256}" \
    --request-rate 0 --max-concurrency 0 --warmup 4 --startup-timeout 180 --pid-file "$pids" --out-dir "$OUT"
  rc=$?
  local p; for p in $(cat "$pids" 2>/dev/null); do kill -KILL -- "-$p" 2>/dev/null; done
  return $rc
}
export -f build_twcomm tw_comm_tests tw_comm_auto tdist_auto ep_serving pd_saturated
