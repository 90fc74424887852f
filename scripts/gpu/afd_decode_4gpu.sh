#!/usr/bin/env bash
# AFD decode vs colocated on 4 GPUs (budget 180 s): AFD (MegaScale-Infer attention/FFN disaggregation) in the 4-GPU
# layouts 2 attention + 2 FFN and 1 attention + 3 FFN, Qwen3-30B-A3B and Mixtral-8x7B configs (dummy bf16).
#   P (parallel, disjoint GPUs, the colocated baselines): GPU 0: colocated Qwen3 (ModelRunner, Triton attention,
#      fused-MoE Triton, CUDA graphs) at batch 64 and 256 = one of 4 independent replicas. Mixtral: on GPU 1 when it
#      fits one GPU (>= 120 GiB, H200) and TP 2 (sglang.bench_one_batch --tp 2, graphs) on GPUs 2,3 = one of 2
#      replicas; on 80 GB GPUs only TP 2.
#   Then, in this order, as the budget allows (each: start-up with the role bytes, then decode):
#   A: Qwen3 AFD 2 + 2 (attention workers on GPUs 0,1, data parallel, batch per worker 64/256; FFN workers on 2,3,
#      64 experts each), m = 1, 2, 3. C: Mixtral AFD 1 + 3 (experts 3/3/2, 28 GiB per FFN GPU), batch 256, m = 1, 2, 3.
#   B: Qwen3 AFD 1 + 3 (43/43/42 experts), m = 1, 2, 3. D: Mixtral AFD 2 + 2 (42 GiB per FFN GPU), batch 256, m = 2.
#   ~190 s when everything runs; steps past the budget are reported as skipped (pass 240 to be sure of all).
#   X: the deployment-plan crossover (benchmark/afd/crossover.py, the planner of sglang.srt.afd.planner.plan) against
#      the measured colocated per-GPU rate, with the measured Ta/Tf/Tc beside it (CPU only).
# Every setup is its own process (benchmark/afd/bench.py spawns one per measurement); each step has a timeout; OOM / errors are
# logged per step. Each AFD role logs "role attention|ffn (worker i, cuda:x) holds N parameter bytes and K KV bytes".
# Tables: $OUT/afd4_summary.md (status, role bytes, decode tables with Ta/Tf/Tc and the m >= 2(1+Tc/Tf)
# check, best-vs-best per GPU vs the 1.3x target, crossover) and $OUT/afd4_<setup>.md per step.
# Usage (repo root, shared data at ../shared/data or carried as .sd): bash scripts/gpu/afd_decode_4gpu.sh [budget_s]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-180}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/afd_decode_4gpu}"; mkdir -p "$out"
cfg=../shared/data/configs; qwen=$cfg/Qwen--Qwen3-30B-A3B; mixtral=$cfg/mistralai--Mixtral-8x7B-v0.1
common=(--mode decode --load-format dummy --device cuda --input-len 16 --steps 4 --decode-warmup 2)
declare -A status
run() {  # run NAME TIMEOUT_S CMD... : log to $out/NAME.log, record exit status, seconds and any OOM
  local name="$1" t="$2"; shift 2
  [ "$t" -lt 12 ] && { status[$name]="skipped (no time left)"; echo "== $name skipped"; return; }
  echo "== $name (timeout ${t}s, at $(( SECONDS - start ))s)"
  local t0=$SECONDS
  timeout -k 3 "$t" "$@" > "$out/$name.log" 2>&1; local rc=$?
  local oom=""; grep -qiE "out of memory|OutOfMemoryError" "$out/$name.log" && oom=" (CUDA OUT OF MEMORY)"
  status[$name]="$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc")$oom in $(( SECONDS - t0 )) s"
  grep -E "^\||^- role|Error|error" "$out/$name.log" | tail -n 16
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -4
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | sort -n | head -1)
mem_gib=$(( ${mem_mib:-0} / 1024 ))
gpu_kind=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE "H100|H200" || echo H100)
mix1=0; [ "$mem_gib" -ge 120 ] && mix1=1  # colocated Mixtral holds 87 GiB
echo "$ngpu GPUs, ${mem_gib} GiB each ($gpu_kind); colocated Mixtral on one GPU: $([ $mix1 = 1 ] && echo yes || echo no)"
[ "$ngpu" -lt 4 ] && echo "WARNING: fewer than 4 GPUs; the layouts wrap onto the GPUs present"

# P: colocated baselines in parallel on disjoint GPUs
CUDA_VISIBLE_DEVICES=0 run colo_qwen3 75 "$PY" benchmark/afd/bench.py "${common[@]}" --setups colocated \
  --model-path $qwen --batch 64 256 --timeout 70 --json-out "$out/colo_qwen3.json" --results-dir "$out/raw" &
p1=$!
if [ $mix1 = 1 ]; then
  CUDA_VISIBLE_DEVICES=1 run colo_mixtral 75 "$PY" benchmark/afd/bench.py "${common[@]}" --setups colocated \
    --model-path $mixtral --batch 64 256 --timeout 70 --json-out "$out/colo_mixtral.json" --results-dir "$out/raw" &
  p2=$!
fi
CUDA_VISIBLE_DEVICES=2,3 run colo_mixtral_tp2 75 "$PY" -m sglang.bench_one_batch --model-path $mixtral \
  --load-format dummy --tp 2 --batch-size 64 256 --input-len 16 --output-len 7 --skip-tokenizer-init \
  --context-length 64 --cuda-graph-max-bs 256 --result-filename "$out/colo_mixtral_tp2.jsonl" &
p3=$!
wait $p1 ${p2:-} $p3
for k in colo_qwen3 colo_mixtral colo_mixtral_tp2; do  # statuses set in the background subshells are lost
  [ -f "$out/$k.log" ] || continue
  if grep -q "^| colocated\|median throughput" "$out/$k.log"; then status[$k]=ok; else
    status[$k]="FAILED$(grep -qiE 'out of memory' "$out/$k.log" && echo ' (CUDA OUT OF MEMORY)')"; fi
done
[ $mix1 = 1 ] || status[colo_mixtral]="skipped (87 GiB does not fit one ${mem_gib} GiB GPU; TP 2 baseline instead)"

# X (CPU, in the background while the AFD steps run): the plan crossover against the measured colocated rate
mix_tp2=$("$PY" -c "import json,sys
rs=[json.loads(l) for l in open(sys.argv[1])]; print(max(r['median_decode_throughput'] for r in rs) / 2)" \
  "$out/colo_mixtral_tp2.jsonl" 2>/dev/null || echo 0)
xo() {  # xo MODEL_PATH NAME COLO_ARGS...
  local m="$1" n="$2"; shift 2
  timeout 60 "$PY" benchmark/afd/crossover.py --model-path "$m" --gpu "$gpu_kind" "$@" --totals 4 8 16 32 64 \
    --max-micro-batch-size 256 > "$out/afd4_crossover_$n.md" 2>&1
}
{ [ -s "$out/colo_qwen3.json" ] && xo $qwen qwen3 --colocated-json "$out/colo_qwen3.json"
  if [ -s "$out/colo_mixtral.json" ]; then xo $mixtral mixtral --colocated-json "$out/colo_mixtral.json"
  elif [ "${mix_tp2%.*}" -gt 0 ] 2>/dev/null; then xo $mixtral mixtral --colocated-tps-per-gpu "$mix_tp2"; fi; } &
px=$!

afd() {  # afd NAME MODEL N_A N_E TIMEOUT [extra bench args]
  local name="$1" model="$2" na="$3" ne="$4" t="$5"; shift 5
  [ "$t" -lt 25 ] && { status[$name]="skipped (no time left: ${t} s; pass a larger budget)"; return; }
  run "$name" "$t" "$PY" benchmark/afd/bench.py "${common[@]}" --setups afd --model-path "$model" \
    --attention-workers "$na" --ffn-workers "$ne" --timeout $(( t - 5 )) --json-out "$out/$name.json" \
    --results-dir "$out/raw" "$@"
}
cap() { local l; l=$(left); echo $(( l - 8 < $1 ? l - 8 : $1 )); }  # 8 s kept for the summary
afd afd_qwen3_2p2 $qwen 2 2 "$(cap 42)" --batch 64 256 --micro-batches 1 2 3
afd afd_mixtral_1p3 $mixtral 1 3 "$(cap 34)" --batch 256 --micro-batches 1 2 3
afd afd_qwen3_1p3 $qwen 1 3 "$(cap 42)" --batch 64 256 --micro-batches 1 2 3
afd afd_mixtral_2p2 $mixtral 2 2 "$(cap 34)" --batch 256 --micro-batches 2
wait $px

# summary
{
  echo "# AFD on 4 GPUs: 2 + 2 and 1 + 3 vs colocated ($(date -u +%F' '%H:%M) UTC)"
  echo; nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/- GPU /'
  echo "- code: $(git rev-parse --short HEAD 2>/dev/null); command: bash scripts/gpu/afd_decode_4gpu.sh $budget"
  echo "- dummy bf16, input 16 tokens, 2 untimed + 4 timed decode steps (median); AFD = bench_afd.py (eager attention"
  echo "  workers, Triton attention; FFN workers fused-MoE Triton; M2N cuda_ipc); colocated = ModelRunner + CUDA graphs"
  echo "- per GPU: colocated on 1 GPU = one of 4 independent replicas; TP 2 = one of 2 replicas (tok/s / 2)"
  echo; echo "| step | status |"; echo "|---|---|"
  for k in colo_qwen3 colo_mixtral colo_mixtral_tp2 afd_qwen3_2p2 afd_qwen3_1p3 afd_mixtral_1p3 afd_mixtral_2p2; do
    echo "| $k | ${status[$k]:-not run} |"; done
  if [ -s "$out/colo_mixtral_tp2.jsonl" ]; then
    echo; echo "## Mixtral colocated TP 2 (sglang.bench_one_batch --tp 2, GPUs 2,3)"; echo
    echo "| batch | median decode ms | tok/s | tok/s per GPU |"; echo "|---|---|---|---|"
    "$PY" -c "import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l); print(f\"| {r['batch_size']} | {r['median_decode_latency'] * 1e3:.2f} | {r['median_decode_throughput']:.1f} | {r['median_decode_throughput'] / 2:.1f} |\")" \
      "$out/colo_mixtral_tp2.jsonl" 2>&1
  fi
  for k in afd_qwen3_2p2 afd_mixtral_1p3 afd_qwen3_1p3 afd_mixtral_2p2; do
    m=${k#afd_}; m=${m%_*}; js=()
    [ -s "$out/colo_$m.json" ] && js+=("$out/colo_$m.json"); [ -s "$out/$k.json" ] && js+=("$out/$k.json")
    echo; echo "## $k"; echo
    if [ -s "$out/$k.json" ]; then
      "$PY" benchmark/afd/bench.py --mode decode --device cuda --merge "${js[@]}" --results-dir "$out/raw" 2>&1 \
        | sed -n '/^- model:/d;/^- command:/d;/^- /p;/^|/p;/^Best/p;/^$/p' | cat -s | tee "$out/afd4_$k.md"
      [ "$m" = mixtral ] && [ "${mix_tp2%.*}" -gt 0 ] 2>/dev/null && "$PY" -c "import json,sys
a = json.load(open(sys.argv[1]))['afd']; g = a['attention_workers'] + a['ffn_workers']
k, r = max(a['rows'].items(), key=lambda kv: kv[1]['tps'])
x = r['tps'] / g / float(sys.argv[2])
print(f'Best vs colocated TP 2 per GPU: AFD (m,batch)={k} {r[\"tps\"] / g:.1f} vs {float(sys.argv[2]):.1f} -> {x:.2f}x (target >= 1.3x: {\"met\" if x >= 1.3 else \"not met\"})')" \
        "$out/$k.json" "$mix_tp2" 2>&1
    else
      grep -hE "Error|error|out of memory" "$out/$k.log" 2>/dev/null | tail -4 | cut -c1-400
    fi
  done
  for n in qwen3 mixtral; do
    [ -s "$out/afd4_crossover_$n.md" ] || continue
    echo; echo "## Plan crossover, $n (python benchmark/afd/crossover.py; planner = sglang.srt.afd.planner.plan)"; echo
    cat "$out/afd4_crossover_$n.md"
  done
} > "$out/afd4_summary.md"
echo; echo "===== summary ($(( SECONDS - start )) s)"; cat "$out/afd4_summary.md"
