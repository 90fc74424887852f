#!/usr/bin/env bash
# AFD fault handling: an FFN worker SIGKILLed during AFD decode on GPUs, one worker per GPU. Budget 150 s on
# 4 GPUs (H100/H200), every step under `timeout`, steps continue on failure, every server stopped at exit.
# test/integration/test_afd_server.py with SGLANG_AFD_TEST_DEVICE=cuda (fp32, torch_native attention; the test
# checks from the workers' start-up lines that each worker sits on its own GPU), six jobs side by side (each server
# has its workers on distinct GPUs; the servers share the 4 GPUs, the model is tiny):
#   g_ipc / g_push / g_ll: test_afd_1_attention_2_ffn_greedy_equals_colocated[2]: 1 attention + 2 FFN workers (GPUs
#      0,1,2), m = 2, greedy tokens (stories260K-moe, fp32) == the CPU reference, with --afd-transport cuda_ipc /
#      cuda_push / cuda_push_ll (the last two: device-driven steps, flag / low-latency protocol).
#   k_ipc / k_push / k_ll: test_afd_2_attention_2_ffn_concurrent_load_then_ffn_killed: 2 attention + 2 FFN (GPUs 0-3),
#      8 concurrent greedy requests == the CPU reference, /flush_cache on both workers; then 2 plain + 2 streamed
#      480-token requests in flight, FFN worker 1 SIGKILLed: every client gets its error (HTTP 503 / a stream's
#      error event after greedy-correct tokens) within --afd-timeout-s 15 + 5 s, /health 503, a new request 503,
#      no worker outlives the server. The test prints "[afd-kill] ... clients' errors after a, b, c, d s". Then the
#      surviving side: both attention workers give up on the dead FFN worker (--afd-timeout-s), fail what they held
#      and free every KV slot (/get_server_info: available_tokens == max_total_tokens, nothing running, waiting,
#      cached or locked), /flush_cache 200 and a new request 503, each within 10 s; a second "[afd-kill] attention
#      workers freed every KV slot ... s after the kill" line.
# Summary: $OUT/afd_kill.md (status per job, the [afd-kill] lines with each client's seconds to its error);
# the tails of the servers' logs of failed jobs: $OUT/server_logs_tail.txt.
# Usage (repo root; data at ../shared/data or carried as .sd): bash scripts/gpu/afd_kill_4gpu.sh [budget_s=150]
# CPU: the same tests run with the default device (SGLANG_AFD_TEST_DEVICE unset).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-150}"; start=$SECONDS
out="${OUT:-/tmp/afd_kill}"; mkdir -p "$out"
mark="$out/.start"; : > "$mark"
kill_all() { local p; for p in $(jobs -p); do kill -TERM "$p" 2>/dev/null; done; }
trap kill_all EXIT INT TERM
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -4
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "GPUs: $ngpu (the kill test needs 4, the greedy test 3; fewer -> those tests skip)"

t=$(( budget - 15 )); [ "$t" -gt 130 ] && t=130  # k_*: ~60 s before the KV-free check, which adds ~15-20 s
f=test/integration/test_afd_server.py
declare -A jobs_=(
  [g_ipc]="cuda_ipc $f::test_afd_1_attention_2_ffn_greedy_equals_colocated[2]"
  [g_push]="cuda_push $f::test_afd_1_attention_2_ffn_greedy_equals_colocated[2]"
  [k_ipc]="cuda_ipc $f::test_afd_2_attention_2_ffn_concurrent_load_then_ffn_killed"
  [k_push]="cuda_push $f::test_afd_2_attention_2_ffn_concurrent_load_then_ffn_killed"
  [g_ll]="cuda_push_ll $f::test_afd_1_attention_2_ffn_greedy_equals_colocated[2]"
  [k_ll]="cuda_push_ll $f::test_afd_2_attention_2_ffn_concurrent_load_then_ffn_killed")
order=(k_ipc g_ipc k_push g_push k_ll g_ll)
echo "== ${#order[@]} jobs side by side (timeout ${t}s each, at $(( SECONDS - start ))s)"
declare -A jpid status
for k in "${order[@]}"; do
  read -r tr node <<< "${jobs_[$k]}"
  ( t0=$SECONDS
    SGLANG_AFD_TEST_DEVICE=cuda SGLANG_AFD_TEST_TRANSPORT=$tr timeout -k 10 "$t" "$PY" -m pytest -s -q -rs \
      -p no:cacheprovider -o timeout="$t" "$node" > "$out/$k.log" 2>&1
    echo "$? $(( SECONDS - t0 ))" > "$out/$k.rc" ) &
  jpid[$k]=$!
done
for k in "${order[@]}"; do
  wait "${jpid[$k]}"; read -r rc dt < "$out/$k.rc" 2>/dev/null || { rc=99; dt=0; }
  if [ "$rc" -eq 0 ] && grep -qE "[0-9]+ skipped" "$out/$k.log" && ! grep -qE "[0-9]+ passed" "$out/$k.log"; then
    status[$k]="SKIPPED ($(grep -oE "SKIPPED \[.*" "$out/$k.log" | head -1 | sed "s/.*: //" | cut -c1-120)) in $dt s"
  elif [ "$rc" -eq 0 ]; then status[$k]="ok in $dt s"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status[$k]="TIMED OUT after $dt s (rc=$rc)"
  else status[$k]="FAILED rc=$rc in $dt s"; fi
  echo "-- $k: ${status[$k]}"; grep -h -E "\[afd-kill\]|^(FAILED|ERROR)|passed|failed|Error" "$out/$k.log" | tail -4
done

# the server logs of this run (ServerProcess writes /tmp/sglang-test-server-<port>.log): tails of those with errors
: > "$out/server_logs_tail.txt"
for lf in $(find /tmp -maxdepth 1 -name 'sglang-test-server-*.log' -newer "$mark" 2>/dev/null); do
  if grep -qE "Traceback|Error|error" "$lf"; then
    { echo "==== $lf"; grep -E "M2N transport|loaded on|serving experts|FFN worker|Error|error|Traceback" "$lf" \
        | tail -n 40; } >> "$out/server_logs_tail.txt"
  fi
done

{
  echo "# AFD: FFN worker killed during decode, one worker per GPU ($(date -u +%F' '%H:%M) UTC," \
       "$("$PY" -c 'import torch
n = torch.cuda.device_count(); print(f"{n} x {torch.cuda.get_device_name(0)}" if n else "no GPU")' 2>&1 | tail -1))"
  echo; echo "command: bash scripts/gpu/afd_kill_4gpu.sh $budget; total $(( SECONDS - start )) s;" \
    "stories260K-moe fp32, torch_native attention, m = 2, --afd-timeout-s 15 (kill test)"
  echo; echo "| job | transport | layout | checks | status |"; echo "|---|---|---|---|---|"
  for k in "${order[@]}"; do
    read -r tr node <<< "${jobs_[$k]}"
    case $k in
      g_*) lay="1 attn + 2 FFN, 3 GPUs"; chk="greedy == CPU reference (3 prompts x 12 tokens)";;
      k_*) lay="2 attn + 2 FFN, 4 GPUs"; chk="8 concurrent greedy == reference; flush; SIGKILL FFN 1 -> errors, 503; attention KV all free";;
    esac
    echo "| $k | $tr | $lay | $chk | ${status[$k]:-not run} |"
  done
  echo; echo "## clients' seconds from the SIGKILL to their error (bound: 15 + 5 s)"
  for k in k_ipc k_push k_ll; do
    l=$(grep -h "\[afd-kill\]" "$out/$k.log" 2>/dev/null | tail -2 | sed "s/^/- $k: /")
    echo "${l:-- $k: no [afd-kill] line (see $k.log)}"
  done
  echo; for k in "${order[@]}"; do
    grep -h -E "^(FAILED|ERROR)|^E  .*(assert|Error)|[0-9]+ (passed|failed|skipped)" "$out/$k.log" 2>/dev/null \
      | sed "s/^/$k: /" | tail -4; done
} > "$out/afd_kill.md"
echo "== summary ($(( SECONDS - start )) s)"; cat "$out/afd_kill.md"
