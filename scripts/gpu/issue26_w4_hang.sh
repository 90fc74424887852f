#!/usr/bin/env bash
# Issue 26: the world-4 decomposition test under each stream layout (4 GPUs, one rank per GPU; <= 240 s by default).
# History: the 2026-11-27 round-2 run on 4 x H200 stopped test_tdist_decomp_w4_gpu.py in case [schedules] (40 s
# limit). The round-3 run (TDIST_GPU_TIMEOUT=85, live progress notes) read it: no deadlock, the test simply needed
# ~110 s (every op call cost ~0.2 s, host-side input generation; case decomp 28 s, each schedules sub-step 2-3 s,
# steady) and the step limits (36-45 s) were shorter. The case file now draws its inputs on the GPU; the limits
# below leave room for the old speed. Every step prints every rank's progress notes live (TDIST_GPU_PROGRESS=1,
# pytest -s: one note per op call group, "schedules AG ring 3 pc split pushes" etc.), so a stop names the sub-step.
# Steps (each bounded: group timeout, then the step's own limit):
#   1. w4_fix      the defaults: side streams shared per heap (bounded count) and 32 hardware queues;
#   2. w2_decomp   regression: test/gpu/test_tdist_decomp_gpu.py on GPUs 0-1 (all 9 cases, defaults);
#   3. w4_old      (if time) per-op side streams (TDIST_DECOMP_SHARED_STREAMS=0, HeapConfig shared_streams=False)
#                  and CUDA_DEVICE_MAX_CONNECTIONS=8 (the CUDA default; the layout of the round-2 run);
#   4. w4_shared8  (if time) shared streams, 8 queues       } which half of the layout change matters
#   5. w4_perop32  (if time) per-op streams, 32 queues      }
# Reading it: a step that stops with its ranks' notes still advancing ran out of time; one whose notes stop in the
# same sub-step on every rank is a hang (CPU proof that submission-order merging cannot deadlock:
# test/unit/test_tdist_decomp_queues.py).
# Outputs in $OUT: issue26_w4_hang.md (summary table), one log per step.
# Usage (repo root): bash scripts/gpu/issue26_w4_hang.sh [seconds, default 240]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-240}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/issue26_w4_hang}"; mkdir -p "$out"
rows=()
W4=test/gpu/test_tdist_decomp_w4_gpu.py
step() {  # step NAME SECONDS GROUP_TIMEOUT SHARED CONNECTIONS TEST: run one bounded pytest, log, summarize
  local name="$1" secs="$2" group="$3" shared="$4" conns="$5" test="$6"
  (( secs > $(left) - 2 )) && secs=$(( $(left) - 2 ))
  if (( secs < 15 )); then rows+=("| $name | $shared | $conns | not run (no time left) | | |"); return; fi
  (( group > secs - 8 )) && group=$(( secs - 8 ))
  echo; echo "== $name (shared streams $shared, CUDA_DEVICE_MAX_CONNECTIONS=$conns, group ${group}s, limit ${secs}s)"
  local t0=$SECONDS
  # GNU timeout leads its own process group: after the step, kill whatever is left in it (a rank stuck in a GPU
  # wait must not hold its GPU into the next step)
  env TDIST_GPU_TIMEOUT="$group" TDIST_GPU_PROGRESS=1 TDIST_DECOMP_SHARED_STREAMS="$shared" \
    CUDA_DEVICE_MAX_CONNECTIONS="$conns" timeout --kill-after=3 "$secs" \
    "$PY" -m pytest -q -s -rA -p no:cacheprovider "$test" > "$out/$name.log" 2>&1 &
  local pid=$!
  wait "$pid"
  local rc=$?
  kill -KILL -- "-$pid" 2>/dev/null && echo "(killed leftover processes of $name)"
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed|did not finish|timed out|Error" "$out/$name.log" | cut -c1-400 | tail -12
  (( rc == 124 || rc == 137 )) && echo "!! $name hit its ${secs}s limit"
  local res last
  res="$(grep -E "[0-9]+ (passed|failed|skipped|error)" "$out/$name.log" | tail -1 | sed 's/=//g; s/^ *//')"
  [ -z "$res" ] && res="no pytest summary (exit $rc)"
  last="$(grep -E '^\[rank [0-9]+\]' "$out/$name.log" \
    | awk '{r=$2; sub(/\]/, "", r); $1=""; $2=""; sub(/^ +/, ""); l[r]=$0; if (r > n) n=r}
           END {for (k=0; k<=n; k++) if (k in l) printf "r%d: %s; ", k, l[k]}')"
  rows+=("| $name | $shared | $conns | $res | $(( SECONDS - t0 ))s | ${last:-none} |")
}
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
ngpu="$(nvidia-smi -L 2>/dev/null | wc -l)"
echo "$ngpu x $gpu, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

step w4_fix 120 110 1 32 "$W4"
CUDA_VISIBLE_DEVICES=0,1 step w2_decomp 90 80 1 32 test/gpu/test_tdist_decomp_gpu.py
step w4_old 120 110 0 8 "$W4"
step w4_shared8 120 110 1 8 "$W4"
step w4_perop32 120 110 0 32 "$W4"

res="$out/issue26_w4_hang.md"
{
  echo "# Issue 26: world-4 decomposition test, stream layout x hardware queues"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); hardware: $ngpu x $gpu; commit $(git rev-parse --short HEAD 2>/dev/null)"
  echo "- command: bash scripts/gpu/issue26_w4_hang.sh $budget (NVLink multicast off in every process)"
  echo "- shared: HeapConfig.shared_streams (1: side streams shared per heap; 0: per op, the layout of the hang);"
  echo "  connections: CUDA_DEVICE_MAX_CONNECTIONS in every rank; last progress: each rank's last note"
  echo
  echo "| step | shared | connections | result | wall | last progress per rank |"
  echo "|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} > "$res"
echo; cat "$res"
