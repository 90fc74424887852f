#!/usr/bin/env bash
# The four-GPU suite (4 x H100 or H200 of one host, one rank per GPU): named steps, each with its own time limit, run
# in the order listed by `--list`. The default list is what the open GPU work asks for: dense TP (TokenWeave end to
# end and its layer benchmark at TP4, tw-comm's automatic pick, Triton-distributed's auto path at world 4) and MoE /
# disaggregation (EP4 with and without DP attention, PD under saturating load, AFD graphed): ~2800 s, one device call
# per step or two (README.md has the calls). Step framework and knobs: lib_suite.sh; shared steps: lib_multi_gpu.sh.
# Usage (repo root; carry .whl and .sd, see README.md):
#   bash scripts/gpu/four_gpu.sh [STEP|GLOB ...]     e.g. four_gpu.sh tokenweave_e2e tw_comm_auto; all: every step
#   bash scripts/gpu/four_gpu.sh --list              the steps with expected / limit seconds
#   DRY_RUN=1 bash scripts/gpu/four_gpu.sh [steps]   print the commands only
# Outputs: $OUT/four_gpu.{tgz,md,log} (the tarball holds one folder per step).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # repo root, NVLS off, PYTHONPATH, $PY, carried wheels and data
. "$root/scripts/gpu/lib_budget.sh"
. "$root/scripts/gpu/lib_suite.sh"
. "$root/scripts/gpu/lib_multi_gpu.sh"
suite=four_gpu
export PY TRITON_DEFAULT_FP_FUSION=1
unset TDIST_CASES
g() { echo "bash scripts/gpu/$*"; }
pyt='"$PY" -m pytest -q -p no:cacheprovider -rA'

# ---- dense TP4: TokenWeave, tw-comm, Triton-distributed ----
tw_e2e='SERVING_START_S=300 SERVING_WORKLOADS="random:1024:128:256 random:4096:128:128 sharegpt:256" bash scripts/gpu/serving_cases.sh "$m70" "$tok"'
suite_step tokenweave_e2e 320 380 1 "$tw_e2e \"off1|--tp 4\" \"on1|--tp 4 --enable-tokenweave\"" \
  "TokenWeave end to end: Llama-3.3-70B config (dummy) TP4 server off then on: random 1024/128, 4096/128, ShareGPT"
suite_step tokenweave_e2e_2 320 380 1 "$tw_e2e \"off2|--tp 4\" \"on2|--tp 4 --enable-tokenweave\"" \
  "the second off / on pair of tokenweave_e2e (off / on / off / on over the two steps; run it right after)"
suite_step tokenweave_layer 100 130 1 "$(g tokenweave_layer_4gpu.sh '$B')" \
  "TokenWeave layer benchmark TP4 (70B, 4 layers): nccl / nccl_symm / nocomm / tokenweave, eager + graphed, overlap; TP2 test"
suite_step tw_comm_tests 60 90 1 'tw_comm_tests 4' "tw-comm fused AllReduce + RMSNorm variants at world 4 vs the reference"
suite_step tw_comm_auto 100 120 1 'tw_comm_auto 4,2' \
  "tw-comm automatic pick vs best variant, NCCL + norm, NCCL symm, torch symm-mem, worlds 4 and 2 (+ crossover table)"
suite_step tdist_w4_test 110 130 0 "TDIST_GPU_TIMEOUT=110 $pyt test/gpu/test_tdist_decomp_w4_gpu.py" \
  "tdist decomposition at world 4: schedules, pieces, receive streams, graphs, Auto* fallback vs torch"
suite_step tdist_auto 50 70 1 'tdist_auto 4' \
  "Triton-distributed world 4: auto path vs NCCL + cuBLAS and torch symm-mem (70B TP4 shapes, M 2048 / 8192)"
suite_step tokenweave_layer_variants 160 190 0 \
  "TW_EXTRA_VARIANTS=\"tokenweave_full tokenweave_oldcomm tokenweave_selcarve\" TW_SKIP_TP2_TEST=1 TW_BENCH_S=150 TW_OVERLAP_TOKENS=\"1024 4096\" $(g tokenweave_layer_4gpu.sh '$B')" \
  "TokenWeave A/Bs at TP4 in one run: sharded vs full residual, bulk vs pre-bulk comm, selective GEMM carveout"
suite_step tokenweave_layer_fit 160 180 0 "TW_LAYERS=\"1 4\" TW_SKIP_TP2_TEST=1 $(g tokenweave_layer_4gpu.sh '$B')" \
  "TokenWeave fixed per-forward cost: intercept of a 1- and 4-layer fit per variant (target < 0.2 ms)"
suite_step tokenweave_unsplit 120 150 0 tokenweave_unsplit \
  "TP4 forwards TokenWeave does not split: tokenweave vs custom all-reduce vs tw-comm for every call, both orders"
suite_step tokenweave_engine 330 380 0 \
  'build_twcomm && "$PY" benchmark/tokenweave/bench_e2e.py --model-path "$m70" --tp 4 --num-prompts 24 \
     --input-len 4096 --output-len 4 --reps 2 --rounds 2 --chunked-prefill-size 16384 --max-total-tokens 40000 \
     --disable-cuda-graph --budget $(( B - 10 )) --out "$OUT/tokenweave_engine_70b.md"' \
  "prefill-heavy sgl.Engine (70B TP4, 24 x 4096 tokens) TokenWeave off / on / off / on, greedy ids vs the first off run"
suite_step tokenweave_greedy 60 70 0 \
  '"$PY" benchmark/tokenweave/bench_e2e.py --model-path ../shared/data/models/stories260K --load-format auto \
     --dtype bfloat16 --tp 4 --num-prompts 8 --input-len 200 --output-len 16 --reps 1 --rounds 1 --min-tokens 16 \
     --chunked-prefill-size 1024 --max-total-tokens 8192 --cuda-graph-max-bs 8 --budget $(( B - 5 )) \
     --out "$OUT/tokenweave_greedy.md"' \
  "stories260K (trained) TP4 greedy ids TokenWeave on == off, CUDA graphs on, prefills split"
suite_step tw_comm_cta_sweep 100 150 0 tw_comm_cta_sweep \
  "bulk-copy vs other two-shots at 8-32 CTAs vs NCCL / symm baselines, worlds 4 and 2 (tests first)"
suite_step tw_comm_stress 70 90 0 tw_comm_stress \
  "tw-comm back-to-back calls: 100,000 at world 4 (every variant), 20,000 bulk / sharded at world 2, checked vs NCCL"
suite_step tw_comm_racecheck 80 100 0 tw_comm_racecheck "compute-sanitizer racecheck of every tw-comm variant, 2 ranks"
suite_step tdist_stack 100 130 0 \
  '"$PY" benchmark/tdist/bench_layer_stack.py --model-path "$m70" --tp 4 --layers 4 --tokens 4096 8192 --warmup 10 \
     --iters 20 --results-dir "$OUT" --timeout $(( B - 5 ))' \
  "--enable-tdist-overlap layer stack TP4 (70B, 4 layers) vs off and sp_nccl: time, hidden states, greedy tokens"
suite_step tdist_sanitizers 65 80 0 tdist_sanitizers "compute-sanitizer memcheck (GPUs 0,1) and racecheck (GPUs 2,3) of the tdist cases"
suite_step tp_comm_share 300 420 0 tp_comm_share \
  "communication share of the 70B prefill forward at TP 2 and 4 (bench_one_batch --profile-comm vs no-comm)"

# ---- MoE at EP4 ----
suite_step moe_overlap 400 540 1 "$(g tbo_multi_gpu.sh 4 '$B')" \
  "EP4 MoE layer / model (Qwen3-30B-A3B, Mixtral-8x7B): TP, all-reduce EP (+TBO), a2a nccl / tdist (+TBO), no-comm twins"
suite_step ep_serving 480 570 1 'ep_serving 4' \
  "Qwen3-30B-A3B served at EP4: all-reduce EP vs a2a nccl / tdist vs a2a nccl + TBO"
suite_step ep_serving_dp 480 570 1 'ep_serving 4 dp' "the same four under --enable-dp-attention --dp-size 4"
suite_step dp_attention 400 420 0 "$(g dp_attention_gpu.sh '$B')" "DP attention: DP2 server with graphs == TP1 (GPUs 0,1)"

# ---- disaggregation: PD, AFD, M2N ----
suite_step pd_saturated 330 420 1 pd_saturated \
  "PD 1P1D (GPU 0 -> 1, NIXL pull) vs agg vs agg2 with every request at once (8B config, random 1024/128, ShareGPT)"
suite_step afd_graph 175 240 1 "$(g afd_graph_2gpu.sh '$B')" \
  "AFD attention step in one CUDA graph (GPUs 0,1): greedy == colocated, eager vs graphed, Ta / Tf / Tc"
suite_step pd_layouts 220 280 0 "$(g pd_layouts_4gpu.sh '$B')" \
  "PD TP1 -> TP2 and 2P:1D: greedy == aggregated, transfer share of TTFT; ShareGPT pd beside agg2"
suite_step pd_kill 125 140 0 \
  'CUDA_VISIBLE_DEVICES=0,1 PD_KILL_ONLY=1 PD_KILL_MODE=pull OUT=$OUT/pull bash scripts/gpu/pd_2gpu.sh $B &
   CUDA_VISIBLE_DEVICES=2,3 PD_KILL_ONLY=1 PD_KILL_MODE=push OUT=$OUT/push bash scripts/gpu/pd_2gpu.sh $B
   b=$?; wait $!; exit $(( $? || b ))' \
  "decode killed with READs (pull, GPUs 0,1) / WRITEs (push, GPUs 2,3) in flight: clients error, prefill KV freed"
suite_step afd_kill 130 150 0 "$(g afd_kill_4gpu.sh '$B')" \
  "AFD FFN worker SIGKILLed during decode (3 transports): clients error, attention workers free every KV slot"
suite_step afd_decode 190 240 0 "$(g afd_decode_4gpu.sh '$B')" "AFD 2 + 2 and 1 + 3 vs colocated (Qwen3, Mixtral), plan crossover"
suite_step m2n_tests 50 80 0 "$pyt -s test/gpu/test_m2n_multi_gpu.py -k 4gpu" "M2N one rank per GPU at world 4, every transport"

tokenweave_unsplit() {  # --min-tokens 1000000: TokenWeave never splits; both variant orders, eager + graphed
  local rc=0 order
  build_twcomm || return 1
  for order in "tokenweave custom tokenweave_oldcomm" "tokenweave_oldcomm custom tokenweave"; do
    mkdir -p "$OUT/${order%% *}_first"
    # shellcheck disable=SC2086
    "$PY" benchmark/tokenweave/bench_layer.py --tp 4 --layers 4 --model-path "$m70" --tokens 1024 4096 --variants $order \
      --min-tokens 1000000 --iters 7 --warmup 5 --cuda-graph --results-dir "$OUT/${order%% *}_first" \
      --timeout $(( B / 2 - 10 )) || rc=1
  done
  return $rc
}
tw_comm_cta_sweep() {  # the bulk-copy two-shot at few CTAs; a failing bulk test times the others alone
  local w m rc=0
  build_twcomm || return 1
  for w in 4 2; do
    m=twoshot_sharded,twoshot_pipe_sharded,twoshot_bulk,twoshot_bulk_sharded
    TW_COMM_QUICK=1 "$PY" -m pytest -q -p no:cacheprovider "test/gpu/test_tw_comm_gpu.py::test_tw_comm_bulk_gpu[$w]" \
      || { rc=1; m=twoshot_sharded,twoshot_pipe_sharded; }
    mkdir -p "$OUT/w$w"
    "$PY" benchmark/comm/bench_allreduce_rmsnorm.py --worlds "$w" --tokens 1024,4096,8192 --variants "$m" --no-ce \
      --sweep-min-tokens 100000000 --chunk-sweep '' --ctas 8,16,24,32,all --cta-variants "$m" --calls-per-graph 3 \
      --replays 5 --out "$OUT/w$w" || rc=1
  done
  return $rc
}
twcomm_new=(p2p_twoshot_bulk p2p_twoshot_sharded p2p_twoshot_pipe_sharded p2p_twoshot_bulk_sharded ce_sharded)
export twcomm_variants="${twcomm_new[*]}"
tw_comm_stress() {  # 0 ok, 1 a check failed, 2 hang (killed at --timeout)
  local a s=test/gpu/tw_comm_stress_gpus.py
  build_twcomm || return 1
  "$PY" $s --world 4 --calls 100000 --tokens 16 --hidden 8192 --sms 16 --check-every 25000 --timeout 32; a=$?
  # shellcheck disable=SC2086
  "$PY" $s --world 2 --calls 20000 --tokens 16 --hidden 8192 --sms 16 --check-every 10000 --variants $twcomm_variants \
    --timeout 24
  return $(( a || $? ))
}
tw_comm_racecheck() {  # 9: sanitizer errors; 1: a check failed; 2: not done in time
  local a r=(compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 --target-processes all)
  build_twcomm || return 1
  "${r[@]}" "$PY" test/gpu/tw_comm_stress_gpus.py --world 2 --calls 20 --tokens 16 --hidden 1024 --sms 4 \
    --check-every 20 --variants p2p_lamport p2p_oneshot p2p_twoshot p2p_twoshot_pipe ce --timeout 30; a=$?
  # shellcheck disable=SC2086
  "${r[@]}" "$PY" test/gpu/tw_comm_stress_gpus.py --world 2 --calls 20 --tokens 16 --hidden 1024 --sms 4 \
    --check-every 20 --variants $twcomm_variants --timeout 35
  return $(( a || $? ))
}
tdist_sanitizers() {  # two independent 2-rank groups at once; only their summary lines are printed
  local t pm pr a b
  for t in memcheck racecheck; do
    CUDA_VISIBLE_DEVICES=$([ $t = memcheck ] && echo 0,1 || echo 2,3) timeout -k 3 $(( B - 5 )) compute-sanitizer \
      --tool $t --target-processes all "$PY" test/gpu/tdist_sanitizer_case.py all > "$OUT/$t.log" 2>&1 &
    [ $t = memcheck ] && pm=$! || pr=$!
  done
  wait "$pm"; a=$?; wait "$pr"; b=$?
  for t in memcheck racecheck; do
    echo "$t: $(grep -E '^sanitizer (part|case)|ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$t.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
  done
  return $(( a || b ))
}
tp_comm_share() {  # one prefill forward of T tokens with the real communicator and with the no-comm counterfactual
  local tp rc=0
  for tp in ${TPS:-2 4}; do
    "$PY" -m sglang.bench_one_batch --model-path "$m70" --load-format dummy --tokenizer-path "$tok" --dtype bfloat16 \
      --context-length 8200 --device cuda --tp "$tp" --mem-fraction-static 0.75 --batch-size 1 --input-len 1024 \
      --output-len 8 --profile-comm --profile-tokens 1 128 1024 4096 8192 --profile-repeats 3 --run-name "tp$tp" \
      --result-filename "$OUT/tp_comm_share.jsonl" || rc=1
  done
  return $rc
}
export -f tokenweave_unsplit tw_comm_cta_sweep tw_comm_stress tw_comm_racecheck tdist_sanitizers tp_comm_share
suite_main "$@"
