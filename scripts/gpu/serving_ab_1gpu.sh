#!/usr/bin/env bash
# SGLang's one-GPU CI serving tests, the new defaults against the behaviour before this round, in ONE device call
# (<= budget seconds, default 540), each server with the scheduler's step trace on:
#   a. new: the server at its defaults, SGLang's offline test (500 prompts, rate inf, random 4096/2048, range ratio
#      0.0, seed 0);
#   b. old: the same offline test with every change of this round switched back (the A/B baseline):
#      SGLANG_DECODE_SPLIT_POLICY=wave (decode rows in batch order, every row on every split),
#      SGLANG_GRAPH_SHARED_LOGITS=0 (one logits output per captured graph size), SGLANG_CHUNK_CACHE_AT_LAUNCH=0
#      (overlap waits for every non-final prefill chunk's result), --mem-fraction-static 0.85, --cuda-graph-max-bs 160;
#   b2. new_online: a fresh server at its defaults, SGLang's online test (100 prompts at 1 req/s, same lengths), if
#      the budget still holds --min-case-s (it usually does not after a and b: run it in a later call);
#   c. if >= 110 s are left: decode steps at serving batch sizes with variable contexts, balanced vs wave split rule
#      (benchmark/serving/decode_step_profile.py --policies balanced,wave);
#   d. the step-trace report of both runs (old first: the baseline of the common-horizon comparison).
# Output ($OUT, <= 8 files): summary.md (tables, also printed last), run.log, runs.json, report.json, profile.json
# (if c ran), traces.tgz (traces, bench outputs, server log tails), record/serving/<date>_sglang_ci_1gpu_<gpu>.{json,md}.
# Usage (repo root; data at ../shared/data or carried as .sd/):
#   bash scripts/gpu/serving_ab_1gpu.sh [budget_s=540]       # expected ~420 s on one H100 (a + b), 540 with b2 or c
#   SERVING_AB_CPU=1 bash scripts/gpu/serving_ab_1gpu.sh 300           # CPU run: stories260K, 8 prompts of 64/32
#   DRY_RUN=1 bash scripts/gpu/serving_ab_1gpu.sh                      # print the commands only
# Env: SERVING_AB_CASES replaces the case list (';'-separated NAME|ENV|FLAGS|WORKLOADS, see serving_runs.py), e.g.
#   SERVING_AB_CASES="triton8k||--attention-backend triton --context-length 8192|offline;fp8||--quantization fp8|offline"
# SERVING_AB_BASELINE names the baseline case (default old; "" = none).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # cds to the repo root ($root), NVLS off, carried wheels and data, $PY
export OUT="${OUT:-/tmp/serving_ab}"; mkdir -p "$OUT"
work="$(mktemp -d /tmp/serving_ab_work.XXXXXX)"
. "$(dirname "$0")/lib_budget.sh"
start_run "$OUT/run.log" "${1:-540}"
step_dry="${DRY_RUN:-}"
cpu="${SERVING_AB_CPU:-}"
data="$root/../shared/data"
old_env="SGLANG_DECODE_SPLIT_POLICY=wave SGLANG_GRAPH_SHARED_LOGITS=0 SGLANG_CHUNK_CACHE_AT_LAUNCH=0"
old_flags="--mem-fraction-static 0.85 --cuda-graph-max-bs 160"
default_cases="new|||offline;old|$old_env|$old_flags|offline;new_online|||online"
IFS=';' read -r -a cases <<< "${SERVING_AB_CASES-$default_cases}"
baseline="${SERVING_AB_BASELINE-old}"
reserve=35  # seconds kept for the profile decision, the report and packing
driver=("$PY" benchmark/serving/serving_runs.py --work "$work" --trace --md "$work/runs.md"
        --record-dir "$OUT/record" --budget-s "$(( $(left) - reserve ))")
[[ -n "$baseline" ]] && driver+=(--baseline-case "$baseline")
for c in "${cases[@]}"; do [[ -n "$c" ]] && driver+=(--case "$c"); done
if [[ -n "$cpu" ]]; then
  driver+=(--cpu --min-case-s 40 --start-limit-s 120)
  prof_model="$data/models/stories260K"; prof_dev=cpu; prof_dtype=float32; prof_cases=(8x64:var 16x48:var); prof_min=30
else
  prof_model="$data/configs/meta-llama--Meta-Llama-3.1-8B"; prof_dev=cuda; prof_dtype=bfloat16
  prof_cases=(160x2600:var 64x2600:var 24x3000:var 256x1700:var); prof_min=110
fi
[[ -n "$step_dry" ]] && driver+=(--dry-run)
echo "cases: ${cases[*]}; baseline: ${baseline:-none}; work dir $work"

stage "runs: one server per case (serving_runs.py)"
"${driver[@]}" 2>&1 | tee "$work/runs.out"
summary+=("runs: exit ${PIPESTATUS[0]}")
cp "$work/runs.json" "$OUT/runs.json" 2>/dev/null

if (( $(left) >= prof_min + 20 )) || [[ -n "$step_dry" ]]; then
  stage "prof: decode steps at serving batch sizes, variable contexts, balanced vs wave"
  step prof "$(cap 120)" "$PY" benchmark/serving/decode_step_profile.py --model-path "$prof_model" --device "$prof_dev" \
    --dtype "$prof_dtype" --cases "${prof_cases[@]}" --policies balanced,wave --steps 8 --warmup 2 \
    --json "$OUT/profile.json"
else
  summary+=("prof: not run ($(left) s left)")
fi

stage "report"
args=()  # the offline traces, the baseline first (the common-horizon comparison is against the first)
for c in "${cases[@]}"; do
  name="${c%%|*}"; [[ -z "$name" || "${c##*|}" != *offline* ]] && continue
  if [[ "$name" == "$baseline" ]]; then args=(--trace "$name=$work/$name.offline.trace.jsonl" "${args[@]}")
  else args+=(--trace "$name=$work/$name.offline.trace.jsonl"); fi
  args+=(--bench "$name=$work/$name.offline.jsonl")
done
if [[ -n "$step_dry" ]]; then
  printf ' %q' "$PY" benchmark/serving/step_trace_report.py "${args[@]}"; echo
elif ((${#args[@]})); then
  ok=()
  for ((i = 0; i < ${#args[@]}; i += 2)); do [[ -s "${args[i+1]#*=}" ]] && ok+=("${args[i]}" "${args[i+1]}"); done
  if ((${#ok[@]})); then
    timeout 60 "$PY" benchmark/serving/step_trace_report.py "${ok[@]}" --json "$OUT/report.json" \
      --md "$work/report.md" > "$work/report.out" 2>&1 || tail -n 20 "$work/report.out"
  fi
fi
[[ -f "$OUT/prof.log" ]] && mv "$OUT/prof.log" "$work/prof.log"  # its tables go into summary.md
{ cat "$work/runs.md" 2>/dev/null; echo; cat "$work/report.md" 2>/dev/null; echo
  grep -E "^\|" "$work/prof.log" 2>/dev/null; } > "$OUT/summary.md"
tar czf "$OUT/traces.tgz" -C "$work" . 2>/dev/null

stage "summary"
printf '%s\n' "${summary[@]}"
awk '/^### Decode tokens over the common horizon/{on=1} on && /^\|/{print} on && /^$/ && n++{on=0}' "$work/report.md" \
  2>/dev/null
grep -E "^[a-z0-9_-]+: (wall|completed|bench)" "$work/report.md" 2>/dev/null
awk '/policy.*step ms \| .*\/ /{on=1} on && /^\|/{print}' "$work/prof.log" 2>/dev/null
cat "$work/runs.md" 2>/dev/null
rm -rf "$work"
echo "== done in $(elapsed)s"
