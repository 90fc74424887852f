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
budget="${1:-450}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/issue23_gpu_logs}"; mkdir -p "$out"
summary=()
step() {  # step NAME SECONDS CMD...: run with a limit, keep the log, record the exit code, never stop the script
  local name="$1" secs="$2"; shift 2
  (( secs > $(left) )) && secs=$(left)
  (( secs < 20 )) && { summary+=("$name: not run (no time left)"); return; }
  echo; echo "== $name (limit ${secs}s, $(left)s left)"
  local t0=$SECONDS
  timeout --kill-after=10 "$secs" "$@" > "$out/issue23_$name.log" 2>&1
  local rc=$?
  tail -12 "$out/issue23_$name.log"
  summary+=("$name: exit $rc in $(( SECONDS - t0 ))s")
}
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
