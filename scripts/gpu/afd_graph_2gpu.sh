#!/usr/bin/env bash
# AFD (attention/FFN disaggregation): the attention worker's decode step in ONE CUDA graph (device-driven M2N,
# cuda_push), 2 GPUs, budget 240 s (first argument). Attention worker on GPU 0, 1 FFN worker on GPU 1 (1 + 1).
#   A (parallel): correctness first -- benchmark/afd/bench_step_graph.py --check on stories260K-moe (fp32, trained):
#      greedy tokens of graphed AFD (prefill eager, every decode step a replay of one captured graph with the step's
#      inputs copied in; the FFN worker replays its own step graph) equal the colocated model on GPU 0, m = 1 and 2.
#      Beside it, on GPU 1 alone: colocated Qwen3-30B-A3B (dummy bf16) through the ModelRunner with CUDA graphs,
#      batch 32 and 128 (benchmark/afd/bench.py --setups colocated; the check's tiny FFN worker shares GPU 1 for ~20 s).
#   B: Qwen3-30B-A3B dummy 1 + 1, m = 1, 2 x batch 32, 128: decode step eager device-driven vs graphed
#      (benchmark/afd/bench_step_graph.py), tok/s per GPU, Ta; and per row the graphed step's Ta / Tf / Tc with the
#      m >= 2(1 + Tc/Tf) check (afd.step_timing stamps inside a second capture, 3 replays; Tf from the FFN worker).
#   A2 / B2: the same check and timing over --transport cuda_push_ll (the low-latency M2N protocol), B2 if time left.
#   C: if time is left: the host-path AFD of before (cuda_ipc, header per message, eager) with Ta / Tf / Tc
#      (bench_afd.py --setups afd --micro-batches 2), the baseline the graph replaces.
#   Summary: $OUT/afd_graph.md (per-GPU ratio graphed vs colocated computed from the two tables).
# Usage (repo root, shared data at ../shared/data or carried as .sd): bash scripts/gpu/afd_graph_2gpu.sh [240]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-240}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/afd_graph}"; mkdir -p "$out"
qwen=../shared/data/configs/Qwen--Qwen3-30B-A3B
declare -A status
run() {  # run NAME TIMEOUT_S CMD... : log to $out/NAME.log, record exit status and seconds
  local name="$1" t="$2"; shift 2
  [ "$t" -lt 10 ] && { status[$name]="skipped (no time left)"; echo "== $name skipped"; return; }
  echo "== $name (timeout ${t}s, at $(( SECONDS - start ))s)"
  local t0=$SECONDS
  timeout -k 3 "$t" "$@" > "$out/$name.log" 2>&1; local rc=$?
  status[$name]="$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc") in $(( SECONDS - t0 )) s"
  echo "${status[$name]}" > "$out/$name.status"  # a run in the background (&) sets status only in its subshell
  grep -E "^\||CHECK|Error|error" "$out/$name.log" | tail -n 16
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -2

# A: correctness (GPU 0 + 1) beside colocated Qwen3 (GPU 1 only)
CUDA_VISIBLE_DEVICES=1 run colo_qwen3 60 "$PY" benchmark/afd/bench.py --mode decode --load-format dummy --device cuda \
  --ffn-workers 1 --batch 32 128 --input-len 16 --steps 4 --decode-warmup 2 --setups colocated \
  --model-path $qwen --timeout 55 --results-dir "$out" &
pid=$!
run check 45 "$PY" benchmark/afd/bench_step_graph.py --check --micro-batches 1 2 --batch 4 --input-len 6 --steps 6 \
  --timeout 30 --md-out "$out/check.md"
wait $pid
status[colo_qwen3]=$(cat "$out/colo_qwen3.status" 2>/dev/null || echo "no status (see colo_qwen3.log)")
run check_ll 45 "$PY" benchmark/afd/bench_step_graph.py --check --micro-batches 1 2 --batch 4 --input-len 6 --steps 6 \
  --timeout 30 --transport cuda_push_ll --md-out "$out/check_ll.md"

# B: Qwen3 1 + 1, eager device-driven vs graphed
bt=$(( $(left) - 15 )); [ $bt -gt 70 ] && bt=70
run graph_qwen3 $bt "$PY" benchmark/afd/bench_step_graph.py --model-path $qwen --load-format dummy --batch 32 128 \
  --micro-batches 1 2 --input-len 16 --steps 6 --warmup 2 --stage-steps 3 --timeout 40 --md-out "$out/graph_qwen3.md"
bt=$(( $(left) - 45 )); [ $bt -gt 70 ] && bt=70
run graph_qwen3_ll $bt "$PY" benchmark/afd/bench_step_graph.py --model-path $qwen --load-format dummy --batch 32 128 \
  --micro-batches 1 2 --input-len 16 --steps 6 --warmup 2 --stage-steps 3 --timeout 40 --transport cuda_push_ll \
  --md-out "$out/graph_qwen3_ll.md"

# C: the host-path AFD (Ta / Tf / Tc) when time is left
run hostpath_qwen3 $(( $(left) - 5 )) "$PY" benchmark/afd/bench.py --mode decode --load-format dummy --device cuda \
  --ffn-workers 1 --batch 32 128 --input-len 16 --steps 3 --decode-warmup 1 --setups afd --micro-batches 2 \
  --transport cuda_ipc --model-path $qwen --timeout 50 --results-dir "$out"

{
  echo "# AFD attention step in one CUDA graph, 1 + 1 on 2 GPUs ($(date -u +%F' '%H:%M) UTC)"
  echo; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -2 | sed 's/^/- GPU: /'
  echo "- command: scripts/gpu/afd_graph_2gpu.sh (logs beside this file)"
  echo; echo "| step | status |"; echo "|---|---|"
  for k in check check_ll colo_qwen3 graph_qwen3 graph_qwen3_ll hostpath_qwen3; do echo "| $k | ${status[$k]:-not run} |"; done
  echo; echo "## Correctness (stories260K-moe)"; cat "$out/check.md" 2>/dev/null || grep -E "Error" "$out/check.log" | tail -3
  echo; echo "## Colocated Qwen3-30B-A3B (1 GPU, CUDA graphs)"; grep -E "^\| colocated|^\| setup|^\|---" "$out/colo_qwen3.log"
  echo; echo "## AFD Qwen3-30B-A3B 1 + 1: eager device-driven vs graphed"
  cat "$out/graph_qwen3.md" 2>/dev/null || grep -E "Error" "$out/graph_qwen3.log" | tail -3
  echo; echo "## Correctness over cuda_push_ll"; cat "$out/check_ll.md" 2>/dev/null \
    || grep -E "Error" "$out/check_ll.log" 2>/dev/null | tail -3
  echo; echo "## AFD Qwen3-30B-A3B 1 + 1 over cuda_push_ll: eager device-driven vs graphed"
  cat "$out/graph_qwen3_ll.md" 2>/dev/null || grep -E "Error" "$out/graph_qwen3_ll.log" 2>/dev/null | tail -3
  echo; echo "## Host-path AFD (before: header per message, eager), Ta / Tf / Tc"
  grep -E "^\| AFD|^\| m |^\| [0-9]" "$out/hostpath_qwen3.log" 2>/dev/null | head -8
  echo; echo "## Graphed AFD per GPU vs colocated (same batch)"
  "$PY" - "$out/colo_qwen3.log" "$out/graph_qwen3.md" <<'PYEOF'
import re, sys
colo = {}
for line in open(sys.argv[1], errors="replace"):
    c = [x.strip() for x in line.split("|")]
    if len(c) > 6 and c[1] == "colocated":
        colo[int(c[3])] = float(c[5])  # batch -> decode tok/s on 1 GPU
try:
    rows = [l for l in open(sys.argv[2]) if re.match(r"^\| \d", l)]
except OSError:
    rows = []
print("| m | batch | graphed tok/s per GPU | colocated tok/s (1 GPU) | ratio |\n|---|---|---|---|---|")
for l in rows:
    c = [x.strip() for x in l.split("|")]
    try:
        m, b, per = int(c[1]), int(c[2]), float(c[7])
    except ValueError:  # a row whose capture failed
        print(f"| {c[1]} | {c[2]} | {c[4]} | | |")
        continue
    base = colo.get(b)
    print(f"| {m} | {b} | {per:.0f} | {base if base else 'n/a'} | {f'{per / base:.2f}x' if base else 'n/a'} |")
PYEOF
} > "$out/afd_graph.md"
echo; echo "===== summary ($(( SECONDS - start )) s)"; cat "$out/afd_graph.md"
