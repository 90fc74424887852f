#!/usr/bin/env bash
# AFD decode vs the colocated baseline on 2 GPUs, each against its memory floor (budget 120 s; ~230 s on an H200
# pair to include Mixtral).
#   A (parallel, one GPU each): GPU 1: colocated Qwen3-30B-A3B (dummy bf16) through the real ModelRunner (Triton
#      attention, fused-MoE Triton, CUDA graphs), batch 32 and 128. GPU 0: test/gpu/test_afd_decode_paths_gpu.py
#      (stories260K-moe: Triton harness and AFD m=2 equal the torch reference; ModelRunner+graphs tokens equal).
#   B: AFD Qwen3-30B-A3B, attention on GPU 0 + 1 FFN worker on GPU 1, m = 1, 2, 3 x batch 32, 128 (one process).
#   C: when Mixtral-8x7B fits one GPU (>= 120 GiB: H200; its FFN worker holds 84 GiB) and >= 100 s are left:
#      colocated Mixtral on GPU 0, then AFD Mixtral as in B.
#   Each setup is its own process; the tables (step ms, tok/s, tok/s per GPU, per-GPU ratio vs colocated at the same
#   batch, memory floor from the copy bandwidth measured in that process, step/floor, Ta/Tf/Tc, m >= 2(1+Tc/Tf),
#   best-vs-best against the 1.3x target) are merged into $OUT/afd_decode.md. Per GPU: colocated on one GPU stands
#   for 2 independent replicas on the 2 GPUs; AFD tok/s is divided by its 2 GPUs.
# Usage (repo root, shared data at ../shared/data or carried as .sd): bash scripts/gpu/afd_decode_2gpu.sh [budget_s]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-120}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/afd_decode_2gpu}"; mkdir -p "$out"
cfg=../shared/data/configs
common=(--mode decode --load-format dummy --device cuda --ffn-workers 1 --batch 32 128 --input-len 16 --steps 4
        --decode-warmup 2 --results-dir "$out")
declare -A status
run() {  # run NAME TIMEOUT_S CMD... : log to $out/NAME.log, record exit status and seconds
  local name="$1" t="$2"; shift 2
  [ "$t" -lt 8 ] && { status[$name]="skipped (no time left)"; echo "== $name skipped"; return; }
  echo "== $name (timeout ${t}s, at $(( SECONDS - start ))s)"
  local t0=$SECONDS
  timeout -k 3 "$t" "$@" > "$out/$name.log" 2>&1; local rc=$?
  status[$name]="$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc") in $(( SECONDS - t0 )) s"
  grep -E "^\||Error|error" "$out/$name.log" | tail -n 14
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -2
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | sort -n | head -1)
mem_gib=$(( ${mem_mib:-0} / 1024 ))
mixtral=0; [ "$mem_gib" -ge 120 ] && mixtral=1  # colocated Mixtral holds 87 GiB, its FFN worker 84 GiB
echo "GPU memory ${mem_gib} GiB -> Mixtral-8x7B $([ $mixtral = 1 ] && echo runs || echo 'skipped (needs >= 120 GiB)')"

# A: colocated Qwen3 on GPU 1 in the background while the correctness test runs on GPU 0
CUDA_VISIBLE_DEVICES=1 run colo_qwen3 55 "$PY" benchmark/afd/bench.py "${common[@]}" --setups colocated \
  --model-path $cfg/Qwen--Qwen3-30B-A3B --timeout 50 --json-out "$out/colo_qwen3.json" &
pid=$!
CUDA_VISIBLE_DEVICES=0 run correctness 40 "$PY" -m pytest -q test/gpu/test_afd_decode_paths_gpu.py -p no:cacheprovider
wait $pid
status[colo_qwen3]="$(grep -q '^| colocated' "$out/colo_qwen3.log" && echo ok || echo FAILED)"

# B: AFD Qwen3, attention on GPU 0 + FFN worker on GPU 1
afd_t=$(( $(left) - 12 ))  # 12 s for the merge below
run afd_qwen3 $(( afd_t > 50 ? 50 : afd_t )) "$PY" benchmark/afd/bench.py "${common[@]}" --setups afd \
  --micro-batches 1 2 3 --model-path $cfg/Qwen--Qwen3-30B-A3B --timeout 50 --json-out "$out/afd_qwen3.json"

# C: Mixtral (colocated on GPU 0, then AFD) when it fits and the budget allows (~100 s more)
if [ $mixtral = 1 ] && [ "$(left)" -ge 100 ]; then
  run colo_mixtral 45 "$PY" benchmark/afd/bench.py "${common[@]}" --setups colocated \
    --model-path $cfg/mistralai--Mixtral-8x7B-v0.1 --timeout 40 --json-out "$out/colo_mixtral.json"
  run afd_mixtral $(( $(left) - 12 )) "$PY" benchmark/afd/bench.py "${common[@]}" --setups afd --micro-batches 1 2 3 \
    --model-path $cfg/mistralai--Mixtral-8x7B-v0.1 --timeout $(( $(left) - 16 )) --json-out "$out/afd_mixtral.json"
else
  why=$([ $mixtral = 1 ] && echo "budget: pass ~230 as the first argument" || echo "does not fit one GPU")
  status[colo_mixtral]="skipped ($why)"; status[afd_mixtral]="skipped ($why)"
fi

# merge into $out/afd_decode.md
{
  echo "# AFD decode vs colocated ($(date -u +%F' '%H:%M) UTC)"
  echo; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -2 | sed 's/^/- GPU: /'
  echo "- shapes: dummy bf16, input 16 tokens, 2 untimed + 4 timed decode steps (median), batches 32 and 128"
  echo "- colocated Qwen3 ran on GPU 1 while the correctness test ran on GPU 0 (separate GPUs)"
  echo "- commands: scripts/gpu/afd_decode_2gpu.sh; benchmark/afd/bench.py ${common[*]} (see the logs)"
  echo; echo "| step | status |"; echo "|---|---|"
  for k in correctness colo_qwen3 colo_mixtral afd_qwen3 afd_mixtral; do echo "| $k | ${status[$k]:-not run} |"; done
  echo; grep -hE "passed|failed|Error" "$out/correctness.log" 2>/dev/null | tail -4
  for m in qwen3 mixtral; do
    js=(); for s in colo afd; do [ -s "$out/${s}_$m.json" ] && js+=("$out/${s}_$m.json"); done
    [ ${#js[@]} -eq 0 ] && continue
    echo; echo "## $m"; echo
    "$PY" benchmark/afd/bench.py --mode decode --device cuda --ffn-workers 1 --merge "${js[@]}" \
      --results-dir "$out/merged" 2>&1 | sed -n '/^- colocated\|^- AFD\|^- floor\|^|\|^Best\|^$/p'
  done
  for k in colo_qwen3 colo_mixtral afd_qwen3 afd_mixtral; do
    grep -h "Error" "$out/$k.log" 2>/dev/null | tail -2 | sed "s/^/$k: /"
  done
} > "$out/afd_decode.md"
echo; echo "===== summary ($(( SECONDS - start )) s)"; cat "$out/afd_decode.md"
