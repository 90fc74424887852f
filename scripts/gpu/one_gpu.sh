#!/usr/bin/env bash
# The one-GPU suite (one H100 or H200): named steps, each with its own time limit, run in the order listed by
# `--list`; the subject scripts beside this file (serving_ab_1gpu.sh, fp8_*.sh, tokenweave_one_gpu.sh, ...) are steps
# too. Step framework and environment knobs: lib_suite.sh; which script answers which question: README.md.
# Usage (repo root; carry .whl and .sd, see README.md):
#   bash scripts/gpu/one_gpu.sh                      the default list (gpu_smoke_a decode_floor, ~470 s)
#   bash scripts/gpu/one_gpu.sh decode_switch_ab     named steps (or globs: 'decode_*'; all: every step)
#   bash scripts/gpu/one_gpu.sh --list               the steps with expected / limit seconds
#   DRY_RUN=1 bash scripts/gpu/one_gpu.sh [steps]    print the commands only
# Outputs: $OUT/one_gpu.{tgz,md,log} (the tarball holds one folder per step).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # repo root, NVLS off, PYTHONPATH, $PY, carried wheels and data
. "$root/scripts/gpu/lib_budget.sh"
. "$root/scripts/gpu/lib_suite.sh"
suite=one_gpu
export PY TRITON_DEFAULT_FP_FUSION=1 data=../shared/data
export m8b=$data/configs/meta-llama--Meta-Llama-3.1-8B tok=$data/tokenizers/llama3
# the decode switches start from their defaults in every step (an A/B sets them per set)
unset SGLANG_DECODE_ATTN_SMALL_GRID_TILE SGLANG_DECODE_PDL SGLANG_SKINNY_GEMM SGLANG_DECODE_GEMM_MAX_M \
  SGLANG_DECODE_GEMM_AUTOTUNE SGLANG_DECODE_FUSE_EPILOGUE SGLANG_TRITON_DECODE_LEGACY SGLANG_FUSED_ROPE_KV
g() { echo "bash scripts/gpu/$*"; }  # a subject script beside this one

# ---- correctness ----
suite_step gpu_smoke 420 450 0 "$(g gpu_suite.sh smoke '$B')" \
  "pytest -m gpu: every GPU code path once (test/README.md tiers); on one H100 it outgrew one call: use _a and _b"
# the smoke tier in two halves of about 55 tests each (on 2026-12-07 the whole tier passed 450 s on one H100)
export smoke_a="test/gpu/test_afd_decode_paths_gpu.py test/gpu/test_afd_gpu.py test/gpu/test_afd_plan_gpu.py
  test/gpu/test_benchmark_timing_gpu.py test/gpu/test_decode_fuse_gpu.py test/gpu/test_decode_gemm_gpu.py
  test/gpu/test_dp_attention_gpu.py test/gpu/test_flashinfer_gpu.py test/gpu/test_fp8_gpu.py test/gpu/test_fp8_kv_gpu.py
  test/gpu/test_gpu_correctness.py test/gpu/test_kv_transfer_gpu.py test/gpu/test_m2n_multi_gpu.py
  test/gpu/test_overlap_device_futures_gpu.py test/gpu/test_server_dummy_llama8b.py"
suite_step gpu_smoke_a 330 450 1 'PYTEST_ARGS="$smoke_a" bash scripts/gpu/gpu_suite.sh smoke $B' \
  "pytest -m gpu, first half (AFD .. the dummy-8B server): decode, FP8, FlashInfer, graphs, KV transfer, M2N"
smoke_b() {  # every other GPU test file: the tests -m gpu selects outside smoke_a
  local f rest=()
  for f in test/gpu/test_*.py; do [[ " $(echo $smoke_a) " == *" $f "* ]] || rest+=("$f"); done
  PYTEST_ARGS="${rest[*]}" bash scripts/gpu/gpu_suite.sh smoke "$B"
}
suite_step gpu_smoke_b 300 450 0 smoke_b \
  "pytest -m gpu, second half (tdist .. TBO): Triton kernels, Triton-distributed, TokenWeave, tw-comm, TP, dispatcher"
suite_step gpu_order 200 300 0 "$(g gpu_suite.sh order '$B')" \
  "the 8B memory-budget test, then the dummy-8B server test, in one pytest process"
decode_tests() {
  "$PY" -m pytest -q -p no:cacheprovider -m gpu test/gpu/test_decode_gemm_gpu.py test/gpu/test_decode_fuse_gpu.py \
    test/gpu/test_overlap_device_futures_gpu.py test/gpu/test_gpu_correctness.py test/gpu/test_triton_kernels_gpu.py \
    -k "decode_gemm or fuse or overlap or cuda_graph_replay_equals_eager or graph_greedy_ids or decode_split_rules \
        or pdl_early_launch_chain or skinny"
}
suite_step decode_tests 100 130 0 decode_tests \
  "decode path: skinny GEMMs + autotuned dispatch, fused epilogues, PDL chains, graph replay == eager, device futures"
suite_step launch_plans 60 150 0 launch_plans \
  "launch_server --dry-run on cuda for every technique (TokenWeave, tdist, AFD, TP placement, PD)"
watchdog() {  # the watchdog test on the GPU, then the request-limit tests (CPU logic, CUDA torch installed)
  SGLANG_TEST_DEVICE=cuda "$PY" -m pytest -x -q -rs -p no:cacheprovider test/integration/test_watchdog_tp_cpu.py
  local a=$?
  "$PY" -m pytest -x -q -p no:cacheprovider test/integration/test_request_limits.py \
    test/unit/test_request_limit_helpers.py test/unit/test_new_user_errors.py
  return $(( a || $? ))
}
suite_step watchdog 150 300 0 watchdog \
  "--watchdog-timeout with TP ranks sharing the GPU (SIGSTOP -> 503 + [DONE], non-zero exit); request limits"
suite_step protocol_parity 200 560 0 "$(g protocol_parity.sh)" "SGLang protocol parity: sampler pieces on CUDA, client tests"
suite_step ray 200 560 0 "$(g ray_gpu.sh)" "--use-ray TP1 / TP2 (ranks sharing the GPU) == the server without Ray"

# ---- decode step vs the memory floor (Llama-3.1-8B config, dummy bf16, batch 1 / 32 / 128 x 1K) ----
decode_floor() {  # SGLang's CLI at the defaults, then the harness / serving-path decode step vs the copy floor
  timeout -k 10 70 "$PY" -m sglang.bench_one_batch --model-path "$m8b" --load-format dummy --tokenizer-path "$tok" \
    --dtype bfloat16 --device cuda --batch-size 1 32 128 --input-len 1024 --output-len 32 \
    --result-filename "$OUT/cli.jsonl" > "$OUT/cli.log" 2>&1
  local a=$?; grep -E "median|Error" "$OUT/cli.log" | tail -n 6
  "$PY" benchmark/decode/step_ab.py --out "$OUT" --settings new --steps 8 --reps 2 --prefill-tokens 0 --serving \
    --serving-steps 24 --serving-warmup 4 --serving-reps 2 --cli-results "$OUT/cli.jsonl"
  return $(( a || $? ))
}
suite_step decode_floor 140 170 1 decode_floor \
  "bench_one_batch at the defaults + decode step (harness, graph replay, served step: overlap off / host / device futures) vs the copy-bandwidth floor"
decode_switch_ab() {  # sets NAME:ENV;...: each set its own graphs (and GEMM table), captured in one process
  "$PY" benchmark/decode/step_ab.py --out "$OUT" --model-path "$m8b" \
    --switch-ab "${DECODE_SETS:-default:;nopdl:SGLANG_DECODE_PDL=0;fuse:SGLANG_DECODE_FUSE_EPILOGUE=1}" \
    --switch-breakdown 32 --batches 32,1,128 --prefill-tokens 0 --serving-steps 10 --serving-warmup 2 --serving-reps 2
}
suite_step decode_switch_ab 220 300 0 decode_switch_ab \
  "decode switches A/B in one process (PDL off, fused epilogues; DECODE_SETS replaces the sets): served step, replay, kernels per step, breakdown at 32"
suite_step decode_gemm_ab 220 300 0 \
  '"$PY" benchmark/decode/step_ab.py --out "$OUT" --model-path "$m8b" --gemm-ab --batches 1,32,128 --settings none \
     --prefill-tokens 0 --serving-steps 16 --serving-warmup 3 --serving-reps 2' \
  "cuBLAS vs autotuned skinny decode GEMMs: served step and replay vs the floor, per-class breakdown"
suite_step decode_gemm_tune 30 60 0 '"$PY" benchmark/decode/gemm_tune.py --out "$OUT" --model-path "$m8b"' \
  "per 8B linear shape and M: cuBLAS vs the best skinny config, fraction of copy bandwidth"
suite_step decode_gemms 60 120 0 '"$PY" benchmark/decode/gemm_kernels.py --out "$OUT"' \
  "decode-sized GEMMs in CUDA graphs (cuBLAS, swapped, GEMV, skinny Triton) vs HBM copy bandwidth"
suite_step decode_configs 30 45 0 '"$PY" benchmark/decode/attention_configs.py --out "$OUT"' \
  "decode attention tile / split configs inside CUDA graphs, batch 1 / 32 / 128"
suite_step decode_memory 50 70 0 '"$PY" -m pytest -q -s -p no:cacheprovider -m gpu test/gpu/test_memory_budget_gpu.py' \
  "KV pool and largest step at the defaults (batch 128 x 1K)"
suite_step decode_profile 60 90 0 \
  '"$PY" benchmark/decode/profile_step.py --batches 1 32 128 --top 16 > "$OUT/profile_decode.txt"; r=$?
   grep -E "^## batch|_decode_|rope|Memcpy" "$OUT/profile_decode.txt" | head -40; exit $r' \
  "kernel table and host ops per decode step (torch profiler)"
suite_step gpu_targets 330 345 0 '"$PY" benchmark/serving/bench_gpu_targets.py --out "$OUT" --time-budget-s $(( B - 10 ))' \
  "floors, decode attention 64 x 4K, decode steps, 8K prefill, bench_serving random 1024/256 at concurrency 64"
suite_step triton_attention 60 120 0 '"$PY" benchmark/attention/bench_triton_attention.py --out "$OUT"' \
  "Triton decode attention micro-benchmark (tile sweep)"

# ---- serving ----
suite_step serving_8b 300 400 0 \
  'SERVING_WORKLOADS="random:1024:256:256:64 sharegpt:500:64" bash scripts/gpu/serving_cases.sh "$m8b" "$tok" "default|"' \
  "one 8B server at its defaults: random 1024/256 and ShareGPT at concurrency 64"
suite_step serving_ab 420 540 0 "$(g serving_ab_1gpu.sh '$B')" "SGLang's CI serving tests, new defaults vs the behaviour before"
suite_step serving_profile 400 420 0 "$(g serving_profile_1gpu.sh '$B')" "where the offline CI workload spends its time"
suite_step fp8_kv 230 240 0 "$(g fp8_kv_1gpu.sh check '$B')" "--kv-cache-dtype fp8_e4m3: tests, BF16 regression, decode attention bench"
suite_step fp8_weights 400 570 0 "FP8_BUDGET_S=\$B $(g fp8_weights_1gpu.sh tests)" "--quantization fp8: GPU tests (other stages: fp8_weights_1gpu.sh)"
suite_step flashinfer 400 540 0 "$(g flashinfer_attention.sh '$B')" "--attention-backend flashinfer: JIT time, tests, vs Triton"

# ---- the multi-GPU techniques with their ranks sharing one GPU ----
suite_step tokenweave_share_gpu 300 540 0 "$(g tokenweave_one_gpu.sh '$B')" "TokenWeave tests, racecheck, layer smoke"
suite_step tdist_share_gpu 450 530 0 "$(g tdist_one_gpu.sh '$B')" "Triton-distributed primitives at world 2 / 4, executor, server"
suite_step afd_share_gpu 300 540 0 "$(g afd_one_gpu.sh '$B')" "AFD: M2N transports, 1 attention + 2 FFN server == colocated"
suite_step ep_a2a_share_gpu 250 360 0 "$(g ep_a2a_one_gpu.sh '$B')" "EP all-to-all dispatcher (nccl, tdist) and EP2 server == TP1"
suite_step tbo 150 170 0 "$(g tbo_one_gpu.sh '$B')" "two-batch overlap: tests, split overhead at EP 1"
suite_step dp_attention_share_gpu 200 420 0 "$(g dp_attention_gpu.sh '$B')" "DP attention: units, DP2 ranks sharing the GPU"
suite_step pd_share_gpu 300 540 0 "$(g pd_disaggregation.sh '$B')" "PD: prefill + decode servers on one GPU, tests and bench"
suite_step pd_push_layerwise 200 300 0 "$(g pd_push_layerwise.sh '$B')" "PD push mode's layerwise KV writes"
suite_step kv_transfer 300 560 0 "$(g kv_transfer.sh)" "KVDirect transfer layer: NIXL VRAM reads / writes, coalescing bench"

launch_plans() {  # the deployment plan of every launch path on cuda (--dry-run: tables only, nothing started)
  local f rc=0
  for f in "--tp 2 --enable-tokenweave" "--tp 2 --enable-tdist-overlap" "--enable-afd --afd-ffn-workers 2" \
           "--tp 2 --base-gpu-id 1 --gpu-id-step 2" "--disaggregation-mode prefill --disaggregation-transfer-backend fake"; do
    echo "== --dry-run $f"
    # shellcheck disable=SC2086
    timeout 60 "$PY" -m sglang.launch_server --dry-run --device cuda $f || { rc=1; echo "FAILED: $f"; }
  done
  return $rc
}
export -f decode_tests watchdog decode_floor decode_switch_ab launch_plans smoke_b
suite_main "$@"
