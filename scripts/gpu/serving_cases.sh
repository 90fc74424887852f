#!/usr/bin/env bash
# Serving throughput and latency of several server settings on one model: one server per case (started here with
# its own flags, stopped after its workloads), `python -m sglang.bench_serving` against it per workload, one table.
# Usage (repo root; data at ../shared/data or carried as .sd/):
#   bash scripts/gpu/serving_cases.sh MODEL TOKENIZER 'NAME|FLAGS' ['NAME|FLAGS' ...]
#   e.g. ... ../shared/data/configs/Qwen--Qwen3-30B-A3B ../shared/data/tokenizers/qwen2 \
#          'ep|--tp 2 --ep-size 2' 'a2a_tbo|--tp 2 --ep-size 2 --moe-a2a-backend nccl --enable-two-batch-overlap'
# Env: SERVING_WORKLOADS (default "random:1024:128:256 sharegpt:256"): each random:IN:OUT:N[:CONC] or
#      sharegpt:N[:CONC] (CONC: --max-concurrency, default none; requests at SERVING_RATE, default inf);
#      SERVING_EXTRA: flags every server gets (default "--load-format dummy --dtype bfloat16");
#      SERVING_START_S: seconds a server may take to become healthy (default 300); SERVING_BENCH_S: limit of one
#      bench_serving run (default 240); SERVING_PORT (default 31871). DRY_RUN=1 prints the commands.
# Output under $OUT: <NAME>.jsonl (one bench_serving record per workload), <NAME>.server.log (its last 300 lines),
# serving_cases.md (case x workload: completed, output tok/s, TTFT mean / p99, TPOT median, ITL p99).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
(( $# >= 3 )) || { sed -n '2,14p' "$0"; exit 2; }
model=$1 tok=$2; shift 2
out="${OUT:-/tmp/serving_cases}"; mkdir -p "$out"
dry="${DRY_RUN:-}"; port="${SERVING_PORT:-31871}"; rate="${SERVING_RATE:-inf}"
read -r -a loads <<< "${SERVING_WORKLOADS:-random:1024:128:256 sharegpt:256}"
sharegpt=../shared/data/datasets/sharegpt/ShareGPT_V3_filtered_1000.json
srv=""
stop() {  # the server's process group: SIGTERM, up to 15 s to exit, then SIGKILL
  [ -n "$srv" ] || return 0
  kill -TERM -- "-$srv" 2>/dev/null
  for (( j = 0; j < 15; j++ )); do kill -0 "$srv" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$srv" 2>/dev/null; srv=""
}
trap stop EXIT INT TERM
bench_args() {  # bench_args WORKLOAD: the bench_serving flags of one workload
  local w=$1 f; IFS=: read -r -a f <<< "$w"
  case ${f[0]} in
    random) echo "--dataset-name random --random-input-len ${f[1]} --random-output-len ${f[2]} --random-range-ratio 1"
            echo "--num-prompts ${f[3]:-256}${f[4]:+ --max-concurrency ${f[4]}}" ;;
    sharegpt) echo "--dataset-name sharegpt --dataset-path $sharegpt --num-prompts ${f[1]:-256}${f[2]:+ --max-concurrency ${f[2]}}" ;;
    *) echo "bad workload '$w'" >&2; return 1 ;;
  esac
}
for spec in "$@"; do
  name=${spec%%|*}; flags=${spec#*|}
  # shellcheck disable=SC2086  # flags are words on purpose
  cmd=("$PY" -m sglang.launch_server --model-path "$model" --tokenizer-path "$tok" ${SERVING_EXTRA:---load-format dummy --dtype bfloat16} $flags --port "$port")
  echo "== case $name: ${cmd[*]}"
  if [ -n "$dry" ]; then
    for w in "${loads[@]}"; do echo "   bench_serving $(bench_args "$w" | tr '\n' ' ')--request-rate $rate"; done; continue
  fi
  rm -f "$out/$name.jsonl"
  setsid "${cmd[@]}" > "$out/$name.server.log" 2>&1 & srv=$!; disown "$srv"
  ok=0
  for (( i = 0; i < ${SERVING_START_S:-300}; i++ )); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && { ok=1; break; }
    kill -0 "$srv" 2>/dev/null || break; sleep 1
  done
  if (( ok )); then
    echo "   healthy after ${i}s"
    for w in "${loads[@]}"; do
      # shellcheck disable=SC2046
      timeout -k 5 "${SERVING_BENCH_S:-240}" "$PY" -m sglang.bench_serving --backend sglang --port "$port" \
        --tokenizer "$tok" $(bench_args "$w") --request-rate "$rate" --disable-tqdm --output-file "$out/$name.jsonl" \
        > "$out/$name.$(echo "$w" | tr ':' '_').log" 2>&1
      echo "   $w: exit $?"
    done
  else
    echo "   server not healthy"; tail -n 30 "$out/$name.server.log"
  fi
  stop
  tail -n 300 "$out/$name.server.log" > "$out/.tail" && mv "$out/.tail" "$out/$name.server.log"
  for (( i = 0; i < 30; i++ )); do  # the next server starts on idle GPUs
    [ "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | wc -l)" -eq 0 ] && break; sleep 1
  done
done
[ -n "$dry" ] && exit 0
"$PY" - "$out" "$@" <<'EOF' | tee "$out/serving_cases.md"
import json, os, sys
out, cases = sys.argv[1], [c.split("|", 1) for c in sys.argv[2:]]
print("| case | flags | workload | completed | output tok/s | TTFT mean ms | TTFT p99 ms | TPOT median ms | ITL p99 ms |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|")
for name, flags in cases:
    path = os.path.join(out, name + ".jsonl")
    recs = [json.loads(x) for x in open(path) if x.strip()] if os.path.exists(path) else []
    if not recs:
        print(f"| {name} | `{flags}` | (no result: see {name}.server.log) | | | | | | |")
    for r in recs:
        w = (f"random {r['random_input_len']}/{r['random_output_len']}" if r["dataset_name"] == "random"
             else r["dataset_name"]) + f", {r['num_prompts']} prompts, conc {r.get('max_concurrency') or '-'}"
        g = lambda k: f"{r[k]:.1f}" if isinstance(r.get(k), (int, float)) else "-"  # noqa: E731
        print(f"| {name} | `{flags}` | {w} | {r['completed']} | {g('output_throughput')} | {g('mean_ttft_ms')} | "
              f"{g('p99_ttft_ms')} | {g('median_tpot_ms')} | {g('p99_itl_ms')} |")
EOF
