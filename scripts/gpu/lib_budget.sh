#!/usr/bin/env bash
# The time-budget block shared by scripts/gpu/*.sh (after device_preamble.sh, which sets $root and $PY):
#   . "$(dirname "$0")/lib_budget.sh"; budget_start "${1:-540}"
# Functions (all print to stdout; none exits the script):
#   budget_start S    budget=S seconds, the clock starts now (start=$SECONDS).
#   left / elapsed    seconds of the budget left / seconds since budget_start.
#   stage NAME        a "== NAME (N s elapsed)" banner.
#   cap WANT          a step's timeout: WANT cut to what is left minus $cap_margin (default 5), at least 5.
#   log_to FILE       from here on this shell's stdout and stderr also go to FILE (appended).
#   commit_id         short HEAD of $root ("unknown" outside a checkout).
#   gpu_name          the first GPU's name (empty without nvidia-smi).
#   start_run LOG S   log_to LOG, budget_start S, then the "environment" stage: commit (sets commit unless set),
#                     GPU name (sets gpu), torch and triton versions.
#   step NAME S CMD...  CMD under `timeout --kill-after=$step_kill S` (default 10), output to
#       ${out:-$OUT}/${step_prefix}NAME.log, then `step_show LOG` (default: its last $step_tail lines, default 15);
#       "${step_item}NAME: exit RC in Ns" appended to the array summary; returns RC (0 when not run). With step_reserve set, S is cut to what is
#       left minus step_reserve; under $step_min seconds (default 10) CMD is not run ("not run (no time left)").
#       With step_dry set (e.g. step_dry=${DRY_RUN:-}), CMD is printed, not run ("dry run"; returns 0).
#   step_bg NAME S CMD...  `step` in the background (steps side by side); step_join waits for every step_bg and
#       appends their summary lines in start order.
#   pidfile_kill FILE      SIGKILL the process group of every pid listed in FILE (e.g. benchmark/disaggregation/bench_pd_serving.py's
#       --pid-file: its servers run in their own sessions), then empty FILE.
#   wait_gpus_idle S       wait (at most S seconds) until nvidia-smi lists no compute process (returns at once
#       without nvidia-smi or with step_dry set).
budget_start() { budget=$1; start=$SECONDS; }
left() { echo $(( budget - (SECONDS - start) )); }
elapsed() { echo $(( SECONDS - start )); }
stage() { echo; echo "== $1 ($(elapsed) s elapsed)"; }
cap() {
  local want=$1 l=$(( $(left) - ${cap_margin:-5} ))
  (( l < want )) && want=$l
  (( want < 5 )) && want=5
  echo "$want"
}
log_to() { exec > >(tee -a "$1") 2>&1; }
# BENCHMARK_GIT_COMMIT (set at the start of a device command) wins: the device copy's .git can be older than its files
commit_id() { [ -n "${BENCHMARK_GIT_COMMIT:-}" ] && { echo "${BENCHMARK_GIT_COMMIT:0:7}"; return; }
  git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown; }
gpu_name() { nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1; }
start_run() {
  log_to "$1"
  budget_start "$2"
  commit="${commit:-$(commit_id)}"
  stage "environment (commit $commit)"
  gpu=$(gpu_name)
  echo "GPU: ${gpu:-unknown}"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" || true
}
step_show() { tail -n "${step_tail:-15}" "$1"; }
summary=()
step() {
  local name="$1" secs="$2"; shift 2
  if [[ -n "${step_reserve:-}" ]] && (( secs > $(left) - step_reserve )); then secs=$(( $(left) - step_reserve )); fi
  (( secs < ${step_min:-10} )) && { summary+=("${step_item:-}$name: not run (no time left)"); return; }
  echo; echo "== $name (limit ${secs}s, $(left)s left)"
  if [[ -n "${step_dry:-}" ]]; then
    printf ' %q' "$@"; echo; summary+=("${step_item:-}$name: dry run (limit ${secs}s)"); return 0
  fi
  local t0=$SECONDS log="${out:-${OUT:-/tmp}}/${step_prefix:-}$name.log" rc
  timeout --kill-after="${step_kill:-10}" "$secs" "$@" > "$log" 2>&1
  rc=$?
  step_show "$log"
  (( rc == 124 || rc == 137 )) && echo "!! $name hit its ${secs}s limit: see $log"
  summary+=("${step_item:-}$name: exit $rc in $(( SECONDS - t0 ))s")
  return "$rc"
}
_bg_pids=(); _bg_names=()
step_bg() {
  local name="$1" f="${out:-${OUT:-/tmp}}/${step_prefix:-}$1.sum"
  rm -f "$f"
  ( step "$@"; printf '%s\n' "${summary[-1]}" > "$f" ) &
  _bg_pids+=("$!"); _bg_names+=("$name")
}
step_join() {
  local i f
  for i in "${!_bg_pids[@]}"; do
    wait "${_bg_pids[$i]}"
    f="${out:-${OUT:-/tmp}}/${step_prefix:-}${_bg_names[$i]}.sum"
    summary+=("$(cat "$f" 2>/dev/null || echo "${step_item:-}${_bg_names[$i]}: no result")")
  done
  _bg_pids=(); _bg_names=()
}
pidfile_kill() {
  local p; for p in $(cat "$1" 2>/dev/null); do kill -KILL -- "-$p" 2>/dev/null; done
  [[ -f "$1" ]] && : > "$1"
  return 0
}
wait_gpus_idle() {
  local i; [[ -n "${step_dry:-}" ]] && return 0; command -v nvidia-smi >/dev/null || return 0
  for (( i = 0; i < $1; i++ )); do
    [[ "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | wc -l)" -eq 0 ]] && return 0
    sleep 1
  done
  echo "!! GPUs still busy after ${1}s:"; nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
}
