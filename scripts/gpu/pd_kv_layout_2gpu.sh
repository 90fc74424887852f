#!/usr/bin/env bash
# PD on 2 GPUs: the KV pool layout A/B (token_major: one NIXL descriptor per slot run instead of
# 2 x layers), push (layerwise) at 8B, and the same-call agg2 baseline. Prefill GPU 0, decode GPU 1, NIXL (UCX,
# CUDA IPC). Budget 420 s by default (every step under `timeout`, steps continue on failure, servers killed at exit):
#   1. (<= 60 s) greedy equality, prefill GPU 0 / decode GPU 1 over NIXL, default (auto) layout, side by side:
#      test_pd_disaggregation.py::test_generate_equals_aggregated[pull] (stories260K) and [push] (stories260K-moe).
#   2. benchmark/disaggregation/bench_pd_serving.py, Llama-3.1-8B config, dummy bf16, llama3 tokenizer, random 1024/128, 48 prompts
#      at 8 req/s (Poisson, no concurrency cap), warm-ups excluded: 4 full-length requests per server at its start,
#      then before every timed run (each row and dataset) a warm-up phase of the same workload at the same rate for
#      5 s (--warmup-seconds: 40 requests, another seed, then a prefix-cache flush), so the first row of a call no
#      longer pays the fresh machine's JIT compiles (2026-11-27: mean TTFT 202-357 ms vs medians of 48-60 ms without
#      it); its transfer counters are read after the phase. One call per row, in this order:
#      tok  = pd pull, --kv-cache-layout token_major on both PD servers;  lay = pd pull, layer_major (the A/B);
#      push = pd push (layerwise; auto = layer_major);  agg2 = two aggregated replicas (GPU 0, 1) behind mini_lb.
#      Each row's limit leaves ~78 s for every later row (the warm-up phase adds ~7 s per dataset).
#   3. ShareGPT (48 prompts at 8 req/s, output 128): tok and agg2 run it on the same servers right after random
#      (~10 s each, no extra server start) when the budget is >= 400 s (PD_ROWS_SHAREGPT=0/1 overrides).
# A server without --kv-cache-layout (a checkout before it): tok/lay collapse into one pull row without the flag
# ("pull (server default layout)"), said in the summary; PD_ROWS_FORCE_LAYOUT=1 passes it anyway (the rows then
# fail at once with the server's "unrecognized arguments", also said).
# Summary: $OUT/pd_kv_layout.md. Usage (repo root; data at ../shared/data or carried as .sd):
#   OUT=/tmp/o bash scripts/gpu/pd_kv_layout_2gpu.sh [budget_s=420]
# PD_ROWS="lay tok tok.2": the rows and their order (a ".N" suffix repeats a row into its own folder);
# PD_ROWS_EQ=par|seq|off (step 1's two tests side by side, one after the other, or not run), PD_ROWS_EQ_S=60
# (each test's limit).
# DRY_RUN=1: print every step's command, run nothing. PD_ROWS_CPU=1: the same flow on CPU (fake backend,
# stories260K, 8 prompts of 64/16; step 1 skipped).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"
out="${OUT:-/tmp/pd_kv_layout}"; mkdir -p "$out"
step_dry="${DRY_RUN:-}"
pids="$out/bench_pids"; : > "$pids"; : > "$out/notes"
trap 'pidfile_kill "$pids"' EXIT INT TERM
start_run "$out/run.log" "${1:-420}"
data=../shared/data
if [ -n "${PD_ROWS_CPU:-}" ]; then
  dev=cpu; backend=fake; model=$data/models/stories260K; tok=()
  wl=(--input-len 64 --output-len 16 --num-prompts 8 --request-rate 8 --warmup 2 --warmup-seconds 1)
  srv="--max-total-tokens 4096"; gp="" gd=""
else
  dev=cuda; backend=nixl; model=$data/configs/meta-llama--Meta-Llama-3.1-8B; tok=(--tokenizer-path $data/tokenizers/llama3)
  wl=(--input-len 1024 --output-len 128 --num-prompts 48 --request-rate 8 --warmup 4 --warmup-seconds 5)
  srv="--load-format dummy --dtype bfloat16 --max-total-tokens 131072 --cuda-graph-max-bs 64"
  gp="--base-gpu-id 0"; gd="--base-gpu-id 1"
fi
nixl=$("$PY" -c "from sglang.srt.disaggregation.transfer.base import nixl_available as a; print(a())" 2>&1 | tail -1)
echo "nixl available: $nixl"
# does this checkout's server take --kv-cache-layout?
has_layout=$("$PY" -c "import argparse
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p); print(int('--kv-cache-layout' in p._option_string_actions))" \
  2>/dev/null | tail -1)
[ -n "${PD_ROWS_FORCE_LAYOUT:-}" ] && has_layout=1
echo "server --kv-cache-layout: $([ "${has_layout:-0}" = 1 ] && echo yes || echo "NO (layout rows collapse into one)")"
sg=${PD_ROWS_SHAREGPT:-$(( budget >= 400 ? 1 : 0 ))}

# ---- 1. greedy equality, prefill GPU 0 -> decode GPU 1 (default layout), side by side ----
stage "1. greedy equality (pull, push) on 2 GPUs"
dis=test/integration/test_pd_disaggregation.py
eqm=${PD_ROWS_EQ:-par}
if [ "$dev" = cuda ] && [ "$eqm" != off ]; then
  t1=$(cap "${PD_ROWS_EQ_S:-60}")
  for m in pull push; do
    [ "$eqm" = seq ] && t1=$(cap "${PD_ROWS_EQ_S:-60}")
    "$([ "$eqm" = seq ] && echo step || echo step_bg)" "eq_$m" "$t1" env SGLANG_PD_TEST_DEVICE=cuda SGLANG_PD_TEST_BACKEND=nixl SGLANG_PD_TEST_SPLIT_GPUS=1 \
      "$PY" -m pytest -s -q -p no:cacheprovider "$dis::test_generate_equals_aggregated[$m]"
  done
  step_join
else
  echo "(skipped on CPU: test/integration/test_pd_disaggregation.py runs there in the suite)"
fi
wait_gpus_idle 15  # the test servers' GPU memory is back before the first 8B server starts

# ---- 2-3. one bench_pd_serving call per row ----
bench=("$PY" benchmark/disaggregation/bench_pd_serving.py --model-path "$model" "${tok[@]}" --device "$dev" --transfer-backend "$backend"
       --server-extra "$srv" "${wl[@]}" --max-concurrency 0 --pid-file "$pids")
datasets=(random); [ "$sg" = 1 ] && datasets=(random sharegpt)
if [ "${has_layout:-0}" = 1 ]; then rows=(tok lay push agg2); else rows=(pull push agg2); fi
declare -A label=([tok]="pd pull token_major" [lay]="pd pull layer_major" [pull]="pd pull (server default layout)"
                  [push]="pd push layerwise (auto layout)" [agg2]="agg2 (2 replicas, mini_lb)")
[ -n "${PD_ROWS:-}" ] && read -r -a rows <<< "$PD_ROWS"
for r in "${rows[@]}"; do [ -z "${label[$r]:-}" ] && label[$r]="${label[${r%%.*}]} (${r##*.})"; done
row_args() {  # row_args ROW: sets flags (bench_pd_serving's setup flags) and the PD servers' extra flags
  local lay=""
  case $1 in
    tok) lay=" --kv-cache-layout token_major"; flags=(--setups pd --transfer-mode pull --dataset "${datasets[@]}") ;;
    lay) lay=" --kv-cache-layout layer_major"; flags=(--setups pd --transfer-mode pull --dataset random) ;;
    pull) flags=(--setups pd --transfer-mode pull --dataset "${datasets[@]}") ;;
    push) flags=(--setups pd --transfer-mode push --dataset random) ;;
    agg2) flags=(--setups agg2 --replica-gpus 0 1 --dataset "${datasets[@]}") ;;
  esac
  prefill_extra="$gp$lay"; decode_extra="$gd$lay"
}
i=0
for r in "${rows[@]}"; do
  i=$(( i + 1 )); later=$(( ${#rows[@]} - i ))
  stage "2. ${label[$r]}"
  row_args "${r%%.*}"
  t=$(( $(left) - 78 * later - 5 )); max=110; [[ " ${flags[*]} " == *" sharegpt "* ]] && max=130
  [ "$t" -gt "$max" ] && t=$max
  step "m_$r" "$t" "${bench[@]}" "${flags[@]}" --prefill-extra "$prefill_extra" --decode-extra "$decode_extra" \
    --startup-timeout $(( t > 40 ? t - 30 : 10 )) --out-dir "$out/$r"
  grep -h "^\[bench_pd_serving\]" "$out/m_$r.log" 2>/dev/null | sed 's/^/    /'
  if grep -qs "unrecognized arguments.*--kv-cache-layout" "$out/$r"/pd_serving_logs/*.log; then
    echo "- the server rejected --kv-cache-layout (this checkout predates it): row ${label[$r]} not measured" \
      | tee -a "$out/notes"
  fi
  pidfile_kill "$pids"; wait_gpus_idle 10
done

# ---- summary ----
stage "summary"
{
  echo "# PD: KV layout A/B, push (layerwise) and agg2 on 2 GPUs ($(date -u +%F' '%H:%M) UTC)"
  echo; echo "- GPU: ${gpu:-unknown} ($(nvidia-smi -L 2>/dev/null | wc -l) visible); commit $commit; device $dev, backend $backend, nixl $nixl"
  echo "- command: \`OUT=... bash scripts/gpu/pd_kv_layout_2gpu.sh $budget\` ($(elapsed) s); server --kv-cache-layout:" \
       "$([ "${has_layout:-0}" = 1 ] && echo yes || echo "no: one pull row with the server's default layout")"
  echo "- rows in call order (one server start each, prefill GPU 0 -> decode GPU 1; agg2 replicas on GPUs 0 and 1):" \
       "${rows[*]}; model $(basename "$model"), $srv"
  echo "- workload: ${wl[*]}, --max-concurrency 0; ShareGPT on the same servers: $([ "$sg" = 1 ] && echo yes || echo no)"
  echo; echo "| step | result |"; echo "|---|---|"
  for s in "${summary[@]}"; do echo "| ${s%%:*} | ${s#*: } |"; done
  for m in pull push; do [ -f "$out/eq_$m.log" ] || continue
    echo "eq_$m: $(grep -h -E "[0-9]+ (passed|failed)|^(FAILED|ERROR)" "$out/eq_$m.log" | tail -2 | tr '\n' ' ')"; done
  echo; cat "$out/notes"
  for ds in "${datasets[@]}"; do
    echo; echo "## $ds"; echo
    rowspec=(); for r in "${rows[@]}"; do [ "$ds" != random ] && { [ "${r%%.*}" = push ] || [ "${r%%.*}" = lay ]; } && continue
      rowspec+=(--row "${label[$r]}=$out/$r"); done
    "$PY" scripts/gpu/pd_rows_table.py --dataset "$ds" "${rowspec[@]}" 2>&1
  done
  echo; echo "## transfer and hand-off per row (from each row's report)"
  for r in "${rows[@]}"; do for f in "$out/$r"/*_pd_serving_*.md; do [ -f "$f" ] || continue
    grep -h "^transfer:\|^decode-side" "$f" | sed "s|^|- ${label[$r]} ($(basename "$f" .md | sed 's/.*_pd_serving_//')): |"; done; done
  echo; echo "Layout A/B (rows in the order above): compare transfer ms/req and"
  echo "READs per request; a share of mean TTFT also moves with the run's queueing (earlier 1K runs: mean TTFT 67-333 ms)."
  echo; echo "Targets: transfer share of TTFT <= 2% (1K input); ITL p99 agg2 / pd >= 1.5; tok/s pd / agg2 >= 0.9."
  echo "Per-row reports (command, hand-off phases): $out/<row>/*_pd_serving_*.md; server logs: $out/<row>/pd_serving_logs/."
} > "$out/pd_kv_layout.md"
cat "$out/pd_kv_layout.md"
