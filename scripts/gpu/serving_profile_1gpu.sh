#!/usr/bin/env bash
# Where SGLang's offline CI workload spends its time on ONE GPU, in one device call (<= budget seconds, default 420):
#   a. base: the server at its defaults (Llama-3.1-8B config, dummy bf16 weights, Llama-3 tokenizer) with the
#      scheduler's step trace on (SGLANG_STEP_TRACE), and SGLang's test_offline_throughput_default workload through
#      bench_serving: random 4096/2048, --random-range-ratio 0.0, 500 prompts, request rate inf, seed 0;
#   b. prof: decode steps at the batch/context the run reaches (benchmark/serving/decode_step_profile.py): graph vs
#      eager step time against the memory floor, attention share of the kernel time;
#   c. variants on the same workload, most promising first, each cut by what is left of the budget (a cut run is
#      still compared with the baseline over the common horizon of their traces): --disable-mixed-chunk (SGLang's
#      default scheduling), --cuda-graph-max-bs 160 and --mem-fraction-static 0.85 (the defaults before 256 / 0.88).
# Output ($OUT, 5 files): summary.md (the report of every trace + the summary table, also printed last),
# run.log (everything printed), report.json, profile.json, traces.tgz (traces, bench JSON lines, server log tails).
# Usage (repo root; data at ../shared/data or carried as .sd/):
#   bash scripts/gpu/serving_profile_1gpu.sh [budget_s=420]
#   SERVING_PROFILE_CPU=1 bash scripts/gpu/serving_profile_1gpu.sh 240   # CPU dry run: stories260K, 8 prompts
#   DRY_RUN=1 bash scripts/gpu/serving_profile_1gpu.sh                     # print the commands only
# Env: SERVING_PROFILE_VARIANTS="name|flags;name|flags" replaces the variant list ("" = none).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # cds to the repo root ($root), NVLS off, carried wheels and data, $PY
export OUT="${OUT:-/tmp/serving_profile}"; mkdir -p "$OUT"
work="$(mktemp -d /tmp/serving_profile_work.XXXXXX)"
. "$(dirname "$0")/lib_budget.sh"
start_run "$OUT/run.log" "${1:-420}"
step_dry="${DRY_RUN:-}"
data="$root/../shared/data"
port=${SERVING_PROFILE_PORT:-30261}
cpu="${SERVING_PROFILE_CPU:-}"
if [[ -n "$cpu" ]]; then
  model="$data/models/stories260K"; tok="$model"; dev=cpu; dtype=float32
  nprompts=8; in_len=64; out_len=32; start_limit=120; prof_cases=(8x64 8x64:var 16x48:var 16x48:var:eager)
  extra_server=(--max-total-tokens 4096); graph_max=0
else
  model="$data/configs/meta-llama--Meta-Llama-3.1-8B"; tok="$data/tokenizers/llama3"; dev=cuda; dtype=bfloat16
  nprompts=500; in_len=4096; out_len=2048; start_limit=180; prof_cases=(160x2560 160x2560:var 200x2048:var 200x2048:var:eager)
  extra_server=(); graph_max=160
fi
default_variants="nomix|--disable-mixed-chunk;cg160|--cuda-graph-max-bs 160;mem85|--mem-fraction-static 0.85"
IFS=';' read -r -a variants <<< "${SERVING_PROFILE_VARIANTS-$default_variants}"
reserve=20         # seconds kept for the report and packing at the end
min_case=100       # a variant needs this much budget left to start (server start + a useful prefix of the run)
[[ -n "$cpu" ]] && min_case=40
labels=(); cases_run=()

pack() {  # the report of every trace so far + traces.tgz (a cut call still returns what finished)
  local args=() b
  for b in "${labels[@]}"; do
    [[ -s "$work/$b.trace.jsonl" ]] && args+=(--trace "$b=$work/$b.trace.jsonl")
    args+=(--bench "$b=$work/$b.bench.jsonl")
  done
  if ((${#labels[@]})); then
    timeout 60 "$PY" benchmark/serving/step_trace_report.py "${args[@]}" --graph-max-bs "$graph_max" \
      --json "$OUT/report.json" --md "$OUT/summary.md" > "$work/report.out" 2>&1 || cat "$work/report.out"
  fi
  tar czf "$OUT/traces.tgz" -C "$work" . 2>/dev/null
}

run_case() {  # NAME [server flags...]: start the server with the trace on, run the workload, stop the server
  local name=$1; shift
  local trace="$work/$name.trace.jsonl" slog="$work/$name.server.log" t0=$SECONDS ok=0 srv lim
  stage "$name: server ${*:-(defaults)}"
  labels+=("$name")
  local cmd=("$PY" -m sglang.launch_server --model-path "$model" --tokenizer-path "$tok" --load-format dummy
             --dtype "$dtype" --device "$dev" --port "$port" "${extra_server[@]}" "$@")
  local bench=("$PY" -m sglang.bench_serving --backend sglang --port "$port" --tokenizer "$tok" --dataset-name random
               --random-input-len "$in_len" --random-output-len "$out_len" --random-range-ratio 0.0
               --num-prompts "$nprompts" --request-rate inf --seed 0 --disable-tqdm
               --output-file "$work/$name.bench.jsonl")
  if [[ -n "$step_dry" ]]; then
    printf ' %q' SGLANG_STEP_TRACE="$trace" "${cmd[@]}"; echo; printf ' %q' "${bench[@]}"; echo
    summary+=("$name: dry run"); return 0
  fi
  SGLANG_STEP_TRACE="$trace" setsid "${cmd[@]}" > "$slog" 2>&1 &
  srv=$!
  while (( SECONDS - t0 < start_limit && $(left) > reserve + 10 )); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1; then ok=1; break; fi
    kill -0 "$srv" 2>/dev/null || break
    sleep 1
  done
  local up=$(( SECONDS - t0 ))
  if (( ok )); then
    lim=$(( $(left) - reserve ))
    echo "server healthy after ${up}s; bench limit ${lim}s"
    timeout --kill-after=5 "$lim" "${bench[@]}" > "$work/$name.bench.out" 2>&1
    local rc=$?
    tail -n 28 "$work/$name.bench.out"
    (( rc == 124 || rc == 137 )) && echo "!! $name: bench cut at ${lim}s (the trace keeps the prefix)"
    summary+=("$name: server up ${up}s, bench exit $rc in $(( SECONDS - t0 - up ))s (flags: ${*:-defaults})")
  else
    echo "!! $name: server not healthy after ${up}s"; tail -n 30 "$slog"
    summary+=("$name: server not healthy after ${up}s")
  fi
  kill -TERM -- "-$srv" 2>/dev/null; sleep 3; kill -KILL -- "-$srv" 2>/dev/null; wait "$srv" 2>/dev/null
  grep -E "Decode batch|Prefill batch" "$slog" | tail -n 3
  grep -vE "Decode batch|Prefill batch" "$slog" | tail -n 60 > "$slog.tail"; grep -E "Decode batch" "$slog" \
    | awk 'NR % 10 == 0' >> "$slog.tail"; mv "$slog.tail" "$slog"
  pack
}

echo "model $model, device $dev, $nprompts prompts random $in_len/$out_len, work dir $work"
run_case base
cases_run+=(base)

stage "prof: decode steps at the run's batch/context"
step prof "$(cap 120)" "$PY" benchmark/serving/decode_step_profile.py --model-path "$model" --device "$dev" \
  --dtype "$dtype" --cases "${prof_cases[@]}" --json "$OUT/profile.json"

for v in "${variants[@]}"; do
  [[ -z "$v" ]] && continue
  name="${v%%|*}"; flags="${v#*|}"
  if (( $(left) < min_case + reserve )) && [[ -z "$step_dry" ]]; then
    summary+=("$name: not run (${flags}; $(left)s left)"); continue
  fi
  # shellcheck disable=SC2086  # flags are words
  run_case "$name" $flags
done

pack
stage "summary"
printf '%s\n' "${summary[@]}"
if [[ -s "$OUT/summary.md" ]]; then  # the horizon table, then one trace line and one bench line per case
  awk '/^### Decode tokens over the common horizon/{on=1} on && /^\|/{print} on && /^$/ && n++{on=0}' "$OUT/summary.md"
  grep -E "^[a-z0-9]+: (wall|completed|bench)" "$OUT/summary.md"
fi
grep -E "^\| [0-9]+ \| [0-9]+ \| (all|uniform)" "$OUT/prof.log" 2>/dev/null
rm -rf "$work"
echo "== done in $(elapsed)s"
