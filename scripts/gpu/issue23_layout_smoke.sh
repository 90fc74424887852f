#!/usr/bin/env bash
# Issue 23 (items 4/5) on ONE GPU, one device call of <= 8 minutes: the moved / refactored GPU paths still work.
#   1. tokenweave  tw-comm JIT-built from its new home (sgl_kernel/tw_comm/build.py finds <repo>/tw-comm) and the
#                  TokenWeave two-stream executor (now on the StagedExecutor skeleton) equals the unsplit forward;
#                  two tw-comm ranks sharing the GPU equal the fp32 reference (test_tokenweave_gpu.py);
#   2. tdist_sp    the sequence-parallel executor (layout installed once, activated per forward) on the fused
#                  Triton-distributed AG-GEMM / GEMM-RS equals the single process on stories260K (test_tdist_gpu.py);
#   3. m2n         M2N round trips on GPU buffers equal the reference for every transport, NIXL included when the
#                  nixl wheel is carried (its agent is now injected by sglang: afd.protocol.create_afd_transport);
#   4. afd_server  (if >= 120 s are left) the one-GPU AFD server (AfdExecutor on the skeleton) equals colocated.
# Every step has a time limit and runs even when an earlier one failed; $OUT/issue23_summary.txt lists exit codes
# (124 = hit its limit; 5 = nothing collected). Usage (repo root): bash scripts/gpu/issue23_layout_smoke.sh [seconds, 450]
set -u
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"  # budget_start, left, step (run with a limit, keep the log, record the exit code)
budget_start "${1:-450}"
out="${OUT:-/tmp/issue23_gpu_logs}"; mkdir -p "$out"
step_prefix=issue23_ step_min=20 step_reserve=0 step_tail=12
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -2
step tokenweave 170 "$PY" -m pytest -q -x -p no:cacheprovider test/gpu/test_tokenweave_gpu.py \
  -k "two_stream_executor_equals_unsplit or tw_comm_two_ranks_on_one_gpu"
step tdist_sp 170 "$PY" -m pytest -q -x -p no:cacheprovider test/gpu/test_tdist_gpu.py \
  -k "sequence_parallel_executor_with_tdist_equals_single_process"
step m2n 90 "$PY" -m pytest -q -p no:cacheprovider test/gpu/test_afd_gpu.py -k "m2n_gpu_round_trips"
if (( $(left) >= 120 )); then
  step afd_server "$(left)" "$PY" -m pytest -q -x -p no:cacheprovider test/gpu/test_afd_gpu.py -k "afd_server_one_gpu"
else
  summary+=("afd_server: not run (no time left)")
fi
echo; echo "== summary (issue 23 layout smoke, $(date -u +%FT%TZ))"
printf '%s\n' "${summary[@]}" | tee "$out/issue23_summary.txt"
