#!/usr/bin/env bash
# The next session's GPU round on ONE warm 4-GPU machine (kind nvidia-h100-x4, lately served by 4 x H200), in step
# groups of <= 560 s wall each, one device call per group (plan, estimates and the exact calls: scripts/gpu/NEXT.md):
#   a  issue 25 planner fix + selective carveout A/B (issue25_ovl_4gpu.sh, alone on the host); issue 24 item 6:
#      AFD FFN-worker kill with the attention side freeing its KV (issue24_afd_kill_4gpu.sh, 4 GPUs); PD decode
#      killed mid-transfer, pull on GPUs 0,1 beside push on GPUs 2,3 (issue24_pd_2gpu.sh, ISSUE24_PD_KILL_ONLY=1)
#   b  issue 24 item 4: ShareGPT pd (token-major) vs agg2 on the same two GPUs, same call (issue24_tok_2gpu.sh);
#      TP1 -> TP2 greedy equality with token-major pools, then TP1 -> TP2 and 2P:1D warm rows (issue24_pd_4gpu.sh)
#   c  issue 24 item 5: graphed AFD Ta / Tf / Tc (issue24_afd_graph_2gpu.sh); issue 27 fuse A/B on one GPU
#      (issue27_fuse_1gpu.sh, CUDA_VISIBLE_DEVICES=0, the other GPUs idle); issue 26 world 4 (issue26_4gpu.sh)
#   d  (only if device time is left) issue 25: unsplit forwards under TokenWeave on the plain communicator, A/B +
#      stress/racecheck of the bulk and sharded variants (issue25_unsplit_4gpu.sh); e2e with the sharded-residual
#      default (issue25_e2e_4gpu.sh)
#   e  (only if device time is left) issue 25: the communicator's own pick (auto column) vs best full / best sharded
#      vs NCCL / torch symm (issue25_ar_4gpu.sh); fixed per-forward cost from a 1- and 4-layer fit (issue25_tw_4gpu.sh)
#   t  a CPU self-test of this script (two steps side by side, one cut by its limit, one not run, packing)
# Benchmark steps run alone on the host; only the GPU-disjoint correctness tests of group a run side by side.
# Every step: its own folder (the sub-script's OUT), a limit cut to the group's wall time left (a step that would
# get less than its minimum is not run), GPUs idle before the next step. After EVERY step the group's folder is
# packed into $OUT/<group>.tgz (one file: what a call brings back; files > 4 MiB travel as their last 4000 lines, at most 2 MB),
# so a call cut by its limit still returns what finished.
# Usage (repo root, carry .whl and .sd): bash scripts/gpu/session_next_4gpu.sh a|b|c|d|e
# SESSION_WALL_S (default 560): the group's wall budget. DRY_RUN=1: print each step's command and limit, run nothing.
set -uo pipefail
g="${1:-}"
case "$g" in a|b|c|d|e|t) ;; *) echo "usage: bash scripts/gpu/session_next_4gpu.sh a|b|c|d|e (t: CPU self-test)"; exit 2 ;; esac
. "$(dirname "$0")/device_preamble.sh"
final="${OUT:-/tmp/session_next_out}"; mkdir -p "$final"
wall="${SESSION_WALL_S:-560}"; dry="${DRY_RUN:-}"; t0=$SECONDS
base=/tmp/session_next; work="$base/$g"; rm -rf "$work" "$base/$g.pack"; mkdir -p "$work"
exec > >(tee -a "$work/session_$g.log") 2>&1
left() { echo $(( wall - (SECONDS - t0) )); }
echo "group $g: $(nvidia-smi -L 2>/dev/null | wc -l) x $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)," \
  "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), wall ${wall}s, preamble done at $(( SECONDS ))s"

pack() {  # $final/$g.tgz from $work (written beside, then renamed: a cut call never returns half a file)
  local tails="$work/_tails" f tmp="$base/$g.tgz.tmp"
  rm -rf "$tails"; mkdir -p "$tails"
  find "$work" -type f -size +4M ! -path "$tails/*" > "$base/$g.big" 2>/dev/null
  while read -r f; do tail -n 4000 "$f" | tail -c 2000000 > "$tails/$(echo "${f#"$work"/}" | tr '/' '_').tail"; done < "$base/$g.big"
  sed "s|^$base/||" "$base/$g.big" > "$base/$g.excl"
  tar czf "$tmp" -C "$base" -X "$base/$g.excl" "$g" 2>/dev/null
  if [ "$(stat -c %s "$tmp" 2>/dev/null || echo 0)" -gt $(( 15 * 1024 * 1024 )) ]; then  # the 16 MiB file limit
    (cd "$base" && find "$g" -type f -size -512k) > "$base/$g.small"
    tar czf "$tmp" -C "$base" -T "$base/$g.small" 2>/dev/null
  fi
  mv -f "$tmp" "$final/$g.tgz"
}

gpus_idle() {  # wait (<= 20 s) until no compute process is left on the GPUs, then SIGKILL what is left, by pid
  [ -n "$dry" ] && return 0; command -v nvidia-smi > /dev/null || return 0
  local i p
  for (( i = 0; i < 20; i++ )); do
    [ "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | wc -l)" -eq 0 ] && return 0; sleep 1
  done
  echo "!! GPU processes left after the step (killed by pid):"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    [ "$p" != "$$" ] && kill -KILL "$p" 2>/dev/null; done
  sleep 2
}

# run_step NAME WANT MIN CMD: CMD (a bash command string; $B = the step's limit - 10 s, the budget to hand a
# sub-script) with OUT=$work/NAME under `timeout LIMIT`, LIMIT = WANT cut to the group's time left - 5 s; not run
# under MIN seconds. Writes $work/NAME.status.
run_step() {
  local name=$1 want=$2 min=$3 cmd=$4 lim l t1 rc st
  l=$(( $(left) - 5 )); lim=$(( want < l ? want : l ))
  mkdir -p "$work/$name"
  if (( lim < min )); then
    st="not run (${lim}s left, needs ${min}s)"
  elif [ -n "$dry" ]; then
    st="dry run (limit ${lim}s): B=$(( lim - 10 )) $cmd"
  else
    echo "== $name: limit ${lim}s, $(( SECONDS - t0 ))s into group $g: $cmd"
    t1=$SECONDS
    B=$(( lim - 10 )) OUT="$work/$name" timeout -k 10 "$lim" bash -c "$cmd" > "$work/$name/stdout.log" 2>&1
    rc=$?
    st="exit $rc in $(( SECONDS - t1 ))s (limit ${lim}s)"
    (( rc == 124 || rc == 137 )) && st="$st TIMED OUT"
  fi
  echo "$name: $st" > "$work/$name.status"; echo "-- $name: $st"
}
# steps NAME WANT MIN CMD [NAME WANT MIN CMD ...]: one step, or several side by side (GPU-disjoint: the caller sets
# CUDA_VISIBLE_DEVICES inside each CMD); then GPUs idle, pack
order=()
steps() {
  local pids=()
  while (( $# >= 4 )); do
    order+=("$1"); run_step "$1" "$2" "$3" "$4" & pids+=($!); shift 4
  done
  wait "${pids[@]}"
  gpus_idle; pack
}

case "$g" in
a)
  steps ovl 285 150 'bash scripts/gpu/issue25_ovl_4gpu.sh $B'
  steps afd_kill 130 80 'bash scripts/gpu/issue24_afd_kill_4gpu.sh $B'
  steps pd_kill_pull 125 80 'CUDA_VISIBLE_DEVICES=0,1 ISSUE24_PD_KILL_ONLY=1 ISSUE24_PD_KILL_MODE=pull bash scripts/gpu/issue24_pd_2gpu.sh $B' \
        pd_kill_push 125 80 'CUDA_VISIBLE_DEVICES=2,3 ISSUE24_PD_KILL_ONLY=1 ISSUE24_PD_KILL_MODE=push bash scripts/gpu/issue24_pd_2gpu.sh $B'
  ;;
b)
  steps tok_sharegpt 270 200 'ISSUE24_TOK_ROWS="tok agg2" ISSUE24_TOK_SHAREGPT=1 ISSUE24_TOK_EQ=off bash scripts/gpu/issue24_tok_2gpu.sh $B'
  steps pd4 280 150 'ISSUE24_PD4_EQ=e_tp12 ISSUE24_PD4_SKIP_SG=1 bash scripts/gpu/issue24_pd_4gpu.sh $B'
  ;;
c)
  steps afd_graph 185 120 'bash scripts/gpu/issue24_afd_graph_2gpu.sh $B'
  steps fuse 200 150 'CUDA_VISIBLE_DEVICES=0 ISSUE27_BUDGET_S=$B bash scripts/gpu/issue27_fuse_1gpu.sh'
  steps w4 115 60 'bash scripts/gpu/issue26_4gpu.sh $B'
  ;;
d)
  steps unsplit 240 150 'bash scripts/gpu/issue25_unsplit_4gpu.sh $B'
  steps e2e 360 200 'ISSUE25_E2E_SKIP_STRESS=1 bash scripts/gpu/issue25_e2e_4gpu.sh $B'
  ;;
e)
  steps ar 110 80 'bash scripts/gpu/issue25_ar_4gpu.sh $B'
  steps tw_fit 170 120 'TW_LAYERS="1 4" TW_SKIP_TP2_TEST=1 bash scripts/gpu/issue25_tw_4gpu.sh $B'
  ;;
t)
  steps t_ok 20 5 'echo "B=$B OUT=$OUT"; head -c 5000000 /dev/zero | tr "\\0" x > "$OUT/big.log"; echo done' \
        t_cut 8 5 'sleep 30'
  steps t_skip 100000 100000 'echo never'
  ;;
esac

echo; echo "===== group $g summary ($(( SECONDS - t0 ))s of ${wall}s)"
for n in "${order[@]}"; do cat "$work/$n.status"; done
for n in "${order[@]}"; do
  echo; echo "----- $n (last lines of its stdout; everything in $g.tgz: $g/$n/)"
  tail -n 22 "$work/$n/stdout.log" 2>/dev/null | cut -c1-220
done
pack
