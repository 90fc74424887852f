#!/usr/bin/env bash
# Named, budgeted steps for the suite scripts (one_gpu.sh, two_gpu.sh, four_gpu.sh), over lib_budget.sh. A suite
# sources device_preamble.sh, lib_budget.sh and this file, declares its steps in run order, then calls suite_main:
#   suite_step NAME EXPECT LIMIT DEFAULT 'COMMAND' 'what it answers'
#     NAME     [a-z0-9_]+; the step's own files go to $work/NAME (its $OUT), its output to $work/NAME.log
#     EXPECT   seconds it is expected to take (from earlier runs or estimates; --list prints them)
#     LIMIT    its time limit (cut to what is left of the suite's budget; under step_min it is not run)
#     DEFAULT  1: in the default list (no step named on the command line); 0: only when named
#     COMMAND  a bash command line, run as `bash -c COMMAND` in the repo root under `timeout` (its process group is
#              killed at the limit) with OUT=$work/NAME and B=LIMIT-10 (a budget to hand a sub-script) exported; a
#              suite's exported functions (export -f) and variables are visible to it
#   suite_main "$@"
#     no argument: the default list; NAME or glob (e.g. 'tokenweave_*'), several allowed, in the order declared;
#     all: every step; --list: the steps with expected / limit seconds and what each answers; --help.
#     Env: DRY_RUN=1 prints each step's command (an exported function: its body) and runs nothing;
#     SUITE_BUDGET_S: the wall budget (default: the selected steps' limits summed + 45 s, at most 575 s, since one
#     device call runs at most 600 s: steps past it are "not run (no time left)"); SUITE_WORK: where steps write
#     (default /tmp/<suite>_work).
# After every step: GPUs idle (wait_gpus_idle 20) and $OUT/<suite>.tgz packed again from $work (files over 4 MiB
# travel as their last 4000 lines; over 15 MiB only files under 512 KiB go in), so a call cut by its limit still
# returns every step that finished. $OUT (default /tmp/<suite>_out) gets <suite>.tgz, <suite>.md (the summary and
# each step's last lines) and <suite>.log; the exit code is 0 only when every selected step exited 0.
# Records: BENCHMARK_RECORD_DIR=$work/records for every step (the default of each benchmark's --record-dir), so the
# tarball carries every record a step wrote (records/<subject>/<date>_<what>_<gpu>.{json,md}).
suite_names=(); declare -A suite_expect suite_limit suite_default suite_cmd suite_what
suite_step() {
  [[ "$1" =~ ^[a-z0-9_]+$ ]] || { echo "suite_step: bad name '$1'"; exit 2; }
  suite_names+=("$1"); suite_expect[$1]=$2; suite_limit[$1]=$3; suite_default[$1]=$4; suite_cmd[$1]=$5
  suite_what[$1]=${6:-}
}

suite_list() {
  local n d tot=0
  echo "$suite.sh steps in run order (* = default list); expected / limit seconds:"
  for n in "${suite_names[@]}"; do
    d=" "; [[ ${suite_default[$n]} == 1 ]] && { d="*"; tot=$(( tot + suite_expect[$n] )); }
    printf '%s %-28s %5s / %-5s %s\n' "$d" "$n" "${suite_expect[$n]}" "${suite_limit[$n]}" "${suite_what[$n]}"
  done
  echo "default list: ~${tot} s expected (one device call runs <= 600 s: name the steps of each call)"
}

suite_select() {  # suite_select ARG...: sets selected (names in declared order)
  local a n hit; local -A want=()
  selected=()
  if (( $# == 0 )); then
    for n in "${suite_names[@]}"; do [[ ${suite_default[$n]} == 1 ]] && want[$n]=1; done
  fi
  for a in "$@"; do
    hit=0
    for n in "${suite_names[@]}"; do
      # shellcheck disable=SC2053  # $a is a glob on purpose
      if [[ $a == all || ($a == default && ${suite_default[$n]} == 1) || $n == $a ]]; then want[$n]=1; hit=1; fi
    done
    (( hit )) || { echo "no step '$a' in $suite.sh (--list names them)"; exit 2; }
  done
  for n in "${suite_names[@]}"; do [[ -n ${want[$n]:-} ]] && selected+=("$n"); done
  return 0
}

suite_pack() {  # $final/$suite.tgz from $work (written beside, then renamed: a cut call never returns half a file)
  local base tails f tmp
  base=$(dirname "$work"); tails="$work/_tails"; tmp="$final/.$suite.tgz.tmp"
  rm -rf "$tails"; mkdir -p "$tails"
  find "$work" -type f -size +4M ! -path "$tails/*" > "$base/.$suite.big" 2>/dev/null
  while read -r f; do tail -n 4000 "$f" | tail -c 2000000 > "$tails/$(echo "${f#"$work"/}" | tr '/' '_').tail"
  done < "$base/.$suite.big"
  sed "s|^$base/||" "$base/.$suite.big" > "$base/.$suite.excl"
  tar czf "$tmp" -C "$base" -X "$base/.$suite.excl" "$(basename "$work")" 2>/dev/null
  if [ "$(stat -c %s "$tmp" 2>/dev/null || echo 0)" -gt $(( 15 * 1024 * 1024 )) ]; then
    (cd "$base" && find "$(basename "$work")" -type f -size -512k) > "$base/.$suite.small"
    tar czf "$tmp" -C "$base" -T "$base/.$suite.small" 2>/dev/null
  fi
  mv -f "$tmp" "$final/$suite.tgz"
}

suite_main() {
  case "${1:-}" in
    --list|-l) suite_list; exit 0 ;;
    --help|-h) sed -n '2,/^set /p' "$0" | sed '$d'; suite_list; exit 0 ;;
  esac
  suite_select "$@"
  (( ${#selected[@]} )) || { echo "no step selected"; exit 2; }
  local n lim sum=45 rc all=0 cmd fn
  for n in "${selected[@]}"; do sum=$(( sum + suite_limit[$n] )); done
  final="${OUT:-/tmp/${suite}_out}"; work="${SUITE_WORK:-/tmp/${suite}_work}"
  mkdir -p "$final"; rm -rf "$work"; mkdir -p "$work"
  out="$work" step_reserve=10 step_min=20 step_dry="${DRY_RUN:-}"
  # every record-writing benchmark a step runs writes its JSON record here (benchmark.common.records), so the tarball
  # carries them:
  # land them with `python -m benchmark.import_records <suite>.tgz --readme README.md`
  export BENCHMARK_RECORD_DIR="$work/records"
  (( sum > 575 )) && sum=575
  start_run "$work/$suite.log" "${SUITE_BUDGET_S:-$sum}"
  echo "$(nvidia-smi -L 2>/dev/null | wc -l) GPU(s) visible; steps: ${selected[*]}; budget ${budget}s"
  for n in "${selected[@]}"; do
    lim=${suite_limit[$n]}; cmd=${suite_cmd[$n]}
    if [[ -n "$step_dry" ]]; then
      lim=$(( lim < $(left) - step_reserve ? lim : $(left) - step_reserve ))
      echo; echo "== $n (limit ${lim}s; expected ${suite_expect[$n]}s): $cmd"
      fn=${cmd%% *}
      [[ "$(type -t "$fn")" == function ]] && declare -f "$fn" | sed 's/^/    /'
      summary+=("$n: dry run (limit ${lim}s)")
      continue
    fi
    mkdir -p "$work/$n"
    OUT="$work/$n" B=$(( lim - 10 )) step "$n" "$lim" bash -c "$cmd"
    rc=$?; (( rc )) && all=1
    wait_gpus_idle 20
    suite_pack
  done
  stage "summary"
  {
    echo "# $suite.sh $(date -u +%FT%TZ), commit ${commit:-?}, $(nvidia-smi -L 2>/dev/null | wc -l) x ${gpu:-no GPU}"
    echo; echo "- NVLink multicast off in every process (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1)"
    echo "- $(elapsed) s of ${budget} s; every step's files: $suite.tgz ($(basename "$work")/<step>/, <step>.log)"
    echo; printf -- '- %s\n' "${summary[@]}"
    local recs; recs=$(cd "$work" && find records -name '*.json' 2>/dev/null | sort)
    echo; echo "- benchmark records: ${recs:-none} (python -m benchmark.import_records $suite.tgz --readme README.md)"
    for n in "${selected[@]}"; do
      [[ -f "$work/$n.log" ]] || continue
      echo; echo "## $n"; echo; echo '```'; tail -n 25 "$work/$n.log" | cut -c1-240; echo '```'
    done
  } > "$work/$suite.md"
  cat "$work/$suite.md"
  cp "$work/$suite.md" "$work/$suite.log" "$final/" 2>/dev/null
  [[ -n "$step_dry" ]] || suite_pack
  return "$all"
}
