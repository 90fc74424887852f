#!/usr/bin/env bash
# Issue 5 (tensor parallelism) on one 8xH200 host, ~6-8 minutes:
#   1. the TP GPU tests (custom all-reduce vs NCCL, TP=2 fp32 greedy == TP=1);
#   2. for TP in 2 4 8: a server with the Llama-3.3-70B config (dummy weights, bf16, context 8192)
#      answers a few /generate requests, then is stopped;
#   3. for TP in 2 4 8: bench_one_batch --profile-comm: one prefill forward of T = 1, 128, 1024, 4096, 8192
#      tokens with the real communicator and with the no-comm counterfactual (same loaded model), plus a
#      static batch (bs 1, in 1024, out 8) for context.
# Writes benchmark/results/comm/<date>_issue5_tp_comm_share.{md,jsonl} (+ server/generate logs); with $OUT set
# (device runner) copies them there too.
# Usage (repo root): bash scripts/gpu/issue5_tp_bench.sh      [TPS="2 4 8"] [PYTHON=python3]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
TPS="${TPS:-2 4 8}"
DATA="$root/../shared/data"
CFG="$DATA/configs/meta-llama--Llama-3.3-70B-Instruct"
TOK="$DATA/tokenizers/llama3"
stamp="$(date -u +%Y%m%d_%H%M)"
res="benchmark/results/comm"
mkdir -p "$res"
jsonl="$res/${stamp}_issue5_tp_comm_share.jsonl"
md="$res/${stamp}_issue5_tp_comm_share.md"
srvlog="$res/${stamp}_issue5_tp_servers.log"
: > "$jsonl"; : > "$srvlog"
hw="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sort | uniq -c | tr '\n' ' ')"
echo "hardware: $hw"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
rc=0

# ---- 1. GPU tests --------------------------------------------------------------------------------------
timeout 300 $PY -m pytest -q -p no:cacheprovider -m gpu test/gpu/test_tp_gpu.py 2>&1 | tee "$res/${stamp}_issue5_tp_gpu_tests.log"
test_rc=${PIPESTATUS[0]}; [[ $test_rc -ne 0 ]] && rc=$test_rc

# ---- 2. serve the 70B config at TP 2/4/8 -----------------------------------------------------------------
server_pid=""
cleanup() { [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null; server_pid=""; }
trap cleanup EXIT
port=31555
for tp in $TPS; do
  echo "=== server TP=$tp ===" | tee -a "$srvlog"
  $PY -m sglang.launch_server --model-path "$CFG" --load-format dummy --tokenizer-path "$TOK" --dtype bfloat16 \
      --context-length 8192 --tp "$tp" --device cuda --port "$port" >> "$srvlog" 2>&1 &
  server_pid=$!
  ok=0
  for _ in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then ok=1; break; fi
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 1
  done
  if [[ $ok -eq 1 ]]; then
    for prompt in "The capital of France is" "Write a haiku about GPUs." "1, 2, 3, 4,"; do
      out=$(curl -s -m 120 "http://127.0.0.1:$port/generate" \
        -d "{\"text\": \"$prompt\", \"sampling_params\": {\"temperature\": 0, \"max_new_tokens\": 16}}")
      echo "TP=$tp generate: $out" | tee -a "$srvlog" | cut -c1-300
      echo "$out" | grep -q '"completion_tokens":16' || { echo "TP=$tp: bad /generate reply"; rc=1; }
    done
    # a small concurrent batch
    pids=()
    for i in 1 2 3 4 5 6 7 8; do
      curl -s -m 120 "http://127.0.0.1:$port/generate" \
        -d "{\"text\": \"Request $i: tell me a story\", \"sampling_params\": {\"max_new_tokens\": 32}}" > /dev/null &
      pids+=($!)
    done
    wait "${pids[@]}"
    echo "TP=$tp: server served requests" | tee -a "$srvlog"
  else
    echo "TP=$tp: server did not become healthy (see $srvlog)"; rc=1
  fi
  cleanup
  sleep 3
done
trap - EXIT

# ---- 3. communication share of the forward ---------------------------------------------------------------
for tp in $TPS; do
  echo "=== bench_one_batch TP=$tp ==="
  timeout 420 $PY -m sglang.bench_one_batch --model-path "$CFG" --load-format dummy --tokenizer-path "$TOK" \
      --dtype bfloat16 --context-length 8200 --device cuda --tp "$tp" --mem-fraction-static 0.75 \
      --batch-size 1 --input-len 1024 --output-len 8 \
      --profile-comm --profile-tokens 1 128 1024 4096 8192 --profile-repeats 3 \
      --run-name "issue5_tp$tp" --result-filename "$jsonl"
  brc=$?; [[ $brc -ne 0 ]] && { echo "bench TP=$tp failed rc=$brc"; rc=$brc; }
done

# ---- table -------------------------------------------------------------------------------------------------
$PY - "$jsonl" "$md" "$hw" <<'EOF'
import json, sys, datetime
jsonl, md, hw = sys.argv[1:4]
recs = [json.loads(l) for l in open(jsonl) if l.strip()]
prof = [r for r in recs if r.get("mode") == "profile_comm"]
static = [r for r in recs if "batch_size" in r]
cmd = ("python -m sglang.bench_one_batch --model-path ../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct "
       "--load-format dummy --dtype bfloat16 --context-length 8200 --device cuda --tp N --batch-size 1 "
       "--input-len 1024 --output-len 8 --profile-comm --profile-tokens 1 128 1024 4096 8192 --profile-repeats 3")
lines = [f"# Issue 5: communication share of the Llama-3.3-70B forward (TP 2/4/8)", "",
         f"- date: {datetime.datetime.utcnow().isoformat(timespec='minutes')}Z",
         f"- hardware: {hw}",
         "- env: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1",
         f"- command: `{cmd}`",
         "- latency: median of 3 prefill forwards (model + sampling, device-synchronized) of T tokens in one request;",
         "  'without' = NO-COMM COUNTERFACTUAL (every TP collective skipped, outputs wrong);",
         "  comm share = 1 - without/with.",
         f"- communicator: {prof[0]['communicator'] if prof else 'n/a'}", "",
         "| TP | T (tokens) | latency with comm (ms) | without comm (ms) | comm share |",
         "|---:|---:|---:|---:|---:|"]
for r in sorted(prof, key=lambda r: (r["tp_size"], r["tokens"])):
    lines.append(f"| {r['tp_size']} | {r['tokens']} | {r['latency_comm_s']*1e3:.2f} | "
                 f"{r['latency_nocomm_s']*1e3:.2f} | {r['comm_share']:.1%} |")
if static:
    lines += ["", "Static batch (bs 1, input 1024, output 8, real communicator):", "",
              "| TP | prefill (ms) | median decode step (ms) | decode tok/s |", "|---:|---:|---:|---:|"]
    for r in sorted(static, key=lambda r: r["tp_size"]):
        lines.append(f"| {r['tp_size']} | {r['prefill_latency']*1e3:.1f} | {r['median_decode_latency']*1e3:.2f} | "
                     f"{r['median_decode_throughput']:.1f} |")
open(md, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF

if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT/benchmark/results/comm"
  cp "$res/${stamp}"_issue5_* "$OUT/benchmark/results/comm/" 2>/dev/null || true
fi
echo "issue5 tp bench rc=$rc (tests rc=$test_rc)"
exit $rc
