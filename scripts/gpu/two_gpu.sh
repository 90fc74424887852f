#!/usr/bin/env bash
# The two-GPU suite (2 x H100 or H200 of one host, one rank per GPU): named steps, each with its own time limit, run
# in the order listed by `--list`. The default list is the MoE / disaggregation runs the open GPU work asks for (EP
# and two-batch overlap with and without DP attention, PD under saturating load, AFD graphed): ~2200 s, so one device
# call per step or two (README.md has the calls). Step framework and knobs: lib_suite.sh; shared steps:
# lib_multi_gpu.sh.
# Usage (repo root; carry .whl and .sd, see README.md):
#   bash scripts/gpu/two_gpu.sh [STEP|GLOB ...]      no argument: the default list; all: every step
#   bash scripts/gpu/two_gpu.sh --list               the steps with expected / limit seconds
#   DRY_RUN=1 bash scripts/gpu/two_gpu.sh [steps]    print the commands only
# Outputs: $OUT/two_gpu.{tgz,md,log} (the tarball holds one folder per step).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # repo root, NVLS off, PYTHONPATH, $PY, carried wheels and data
. "$root/scripts/gpu/lib_budget.sh"
. "$root/scripts/gpu/lib_suite.sh"
. "$root/scripts/gpu/lib_multi_gpu.sh"
suite=two_gpu
export PY TRITON_DEFAULT_FP_FUSION=1
unset TDIST_CASES
g() { echo "bash scripts/gpu/$*"; }
pyt='"$PY" -m pytest -q -p no:cacheprovider -rA'

# ---- MoE: expert parallelism, two-batch overlap, DP attention (EP 2) ----
suite_step moe_overlap 400 540 1 "$(g tbo_multi_gpu.sh 2 '$B')" \
  "EP2 MoE layer / model (Qwen3-30B-A3B, Mixtral-8x7B): TP, all-reduce EP (+TBO), a2a nccl / tdist (+TBO), no-comm twins"
suite_step dp_attention 400 420 1 "$(g dp_attention_gpu.sh '$B')" \
  "DP attention: DP2 server with graphs == TP1 (all-gather EP, nccl a2a, nccl a2a + TBO)"
suite_step ep_serving 480 560 1 'ep_serving 2' \
  "Qwen3-30B-A3B served at EP2: all-reduce EP vs a2a nccl / tdist vs a2a nccl + TBO"
suite_step ep_serving_dp 480 560 1 'ep_serving 2 dp' \
  "the same four under --enable-dp-attention --dp-size 2"

# ---- disaggregation: PD, AFD, M2N ----
suite_step pd_saturated 330 420 1 pd_saturated \
  "PD 1P1D (NIXL pull) vs agg vs agg2 with every request at once (8B config, random 1024/128, ShareGPT)"
suite_step afd_graph 175 240 1 "$(g afd_graph_2gpu.sh '$B')" \
  "AFD attention step in one CUDA graph: greedy == colocated, eager vs graphed, Ta / Tf / Tc (cuda_push, cuda_push_ll)"
suite_step afd_decode 120 240 0 "$(g afd_decode_2gpu.sh '$B')" "AFD 1 + 1 decode vs colocated, Qwen3 (+ Mixtral on H200)"
suite_step pd_2gpu 400 420 0 "$(g pd_2gpu.sh '$B')" \
  "PD across GPUs: greedy == aggregated (pull, push, layerwise), decode killed mid-transfer, pd vs agg vs agg2 at 8 req/s"
suite_step pd_kv_layout 400 420 0 "$(g pd_kv_layout_2gpu.sh '$B')" \
  "PD rows: token_major vs layer_major pools, push (layerwise), agg2 on the same GPUs (+ ShareGPT)"
suite_step nixl_bandwidth 100 110 0 "$(g nixl_bandwidth_2gpu.sh '$B')" "NIXL READ / WRITE per-descriptor cost, UCX settings"
suite_step m2n_tests 80 110 0 "$pyt -s test/gpu/test_m2n_multi_gpu.py -k 2gpu" \
  "M2N one rank per GPU: every transport == inline bytes, 10,000 messages, killed peer fails closed"
suite_step m2n_ipc_probe 30 40 0 '"$PY" scripts/gpu/m2n_ipc_probe.py --budget-s 22 --out "$OUT/m2n_ipc_probe.md"' \
  "which CUDA-IPC open / event strategy delivers equal bytes between two GPUs"
suite_step m2n_push 78 90 0 "$(g m2n_push_2gpu.sh)" "cuda_push M2N: tests, one-way latency vs NCCL send/recv (eager, graphed)"
suite_step m2n_push_ll 90 100 0 "M2N_PROTOCOL=ll $(g m2n_push_2gpu.sh)" \
  "cuda_push_ll (low-latency protocol): tests, latency vs the flag protocol, NCCL and the raw floor"

# ---- dense TP: TokenWeave, tw-comm, Triton-distributed (world 2) ----
suite_step tw_comm_tests 60 90 0 'tw_comm_tests 2' "tw-comm fused AllReduce + RMSNorm variants at world 2 vs the reference"
suite_step tokenweave_tp2_tests 80 100 0 \
  "$pyt test/gpu/test_tokenweave_gpu.py -k \"tp2_one_rank_per_gpu and llama_bias_untied\"" \
  "TokenWeave executor TP2, one rank per GPU (full and sharded residual) vs the fp32 reference"
suite_step tokenweave_layer_tp2 90 120 0 \
  'build_twcomm && "$PY" benchmark/tokenweave/bench_layer.py --tp 2 --layers 4 --model-path "$m70" \
     --tokens 1024 2048 4096 8192 --variants nccl nccl_symm nocomm tokenweave --iters 5 --warmup 5 --cuda-graph \
     --overlap-tokens 4096 --results-dir "$OUT" --profile-dir "$OUT" --timeout $(( B - 30 ))' \
  "TokenWeave layer benchmark TP2 (Llama-3.3-70B, 4 layers), eager + graphed, comm overlap at 4096"
suite_step tw_comm_auto_w2 70 90 0 'tw_comm_auto 2' "tw-comm auto pick vs NCCL + norm and torch symm at world 2"
suite_step tdist_decomp 55 80 0 "TDIST_GPU_TIMEOUT=50 $pyt test/gpu/test_tdist_decomp_gpu.py" \
  "tdist decomposition AG-GEMM / GEMM-RS, one-copy all-to-all, bounded waits, dead peer, graphs"
suite_step tdist_auto_w2 70 90 0 'tdist_auto 2' "Triton-distributed world 2: auto path vs NCCL + cuBLAS (70B TP4 shapes)"
suite_step tdist_memcheck 40 60 0 \
  'compute-sanitizer --tool memcheck --target-processes all "$PY" test/gpu/tdist_sanitizer_case.py a2a' \
  "compute-sanitizer memcheck of the 2-rank one-copy all-to-all"

# ---- smoke of the integrated tree, docs ----
integration_smoke() {
  timeout 30 "$PY" -m sglang.launch_server --dry-run --enable-afd --model-path ../shared/data/models/stories260K-moe \
    --device cuda || return 1
  local p=("$PY" -m pytest -q -p no:cacheprovider -rA) a b
  "${p[@]}" test/gpu/test_gpu_correctness.py -k cuda_graph_replay_equals_eager; a=$?
  "${p[@]}" "test/gpu/test_tokenweave_gpu.py::test_tokenweave_tp_ranks_share_one_gpu[llama_bias_untied-2]" \
    test/gpu/test_tp_gpu.py::test_tp2_server_fp32_greedy_equals_tp1 \
    test/gpu/test_afd_gpu.py::test_afd_server_one_gpu_greedy_equals_colocated; b=$?
  "${p[@]}" test/gpu/test_tdist_gpu.py -k "one_rank_per_gpu and decomp"
  return $(( a || b || $? ))
}
export -f integration_smoke
suite_step integration_smoke 220 270 0 integration_smoke \
  "plan dry run, graphs == eager, TokenWeave / tdist / TP2 / AFD servers and executors on 2 GPUs"
suite_step quickstart_docs 300 450 0 "$pyt test/gpu/test_docs_quickstart_gpu.py" \
  "docs/quickstart.md's GPU blocks as written (one GPU, TP 2 + TokenWeave, PD over NIXL, AFD)"
suite_main "$@"
