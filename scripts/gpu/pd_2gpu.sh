#!/usr/bin/env bash
# PD disaggregation (KVDirect) across 2 GPUs, NIXL (UCX, CUDA IPC): correctness, the decode server killed mid-transfer,
# and PD vs one aggregated server vs two replicas under load.
# Budget 420 s on 2 x H100 (every step under `timeout`, steps continue on failure, every server killed at exit):
#   0. nixl imports from the carried slim wheel (device_preamble.sh installs .whl/nixl_cu13-*.whl into /tmp/site).
#   1. correctness (with test_scheduler_process_device.py: a worker on --base-gpu-id 1 makes cuda:1 current),
#      prefill on GPU 0 and decode on GPU 1 (SGLANG_PD_TEST_SPLIT_GPUS=1), side by side:
#      a. test_pd_disaggregation.py [pull] (stories260K): greedy /generate and streaming == the aggregated server
#         (GPU 0) token for token, logprobs included;  b. [push] (stories260K-moe) the same in push mode;
#      c. test_pd_push_layerwise.py: push mode's layerwise WRITEs (and the after-the-fact path) == aggregated;
#   1b. decode killed mid-transfer, its own step (limit PD_KILL_S, default 180 s): test_pd_faults.py::test_decode_killed_mid_transfer
#      [pull] and [push]: the decode server (GPU 1) SIGKILLed while the KV transfers of 3 requests are posted and not
#      complete (pull: its NIXL READs; push: the prefill side's WRITEs into it), held there by the test-only
#      SGLANG_PD_FAULT_HOLD_TRANSFER_S hook (disaggregation/transfer/fault_hook.py) and asserted in flight from
#      /get_server_info at the kill: every client gets an error within 10 s (never 200 with tokens), the prefill side
#      fails the rooms and frees their KV (back to the pre-request value), then serves through a second decode server.
#   2. measurement, Llama-3.1-8B config, dummy bf16, llama3 tokenizer, random 1024 in / 128 out, 48 prompts at
#      8 req/s (Poisson, no concurrency cap), warm-ups excluded (benchmark/disaggregation/bench_pd_serving.py: 4 requests per server
#      at its start, then a 5 s warm-up phase of the same workload before every timed run, --warmup-seconds):
#      P = prefill GPU 0 + decode GPU 1 via mini_lb (pull), (a) one aggregated server on GPU 0,
#      (b) two aggregated replicas (GPU 0, GPU 1) behind mini_lb --workers; TTFT, TPOT, ITL p99, output
#      throughput, KV transfer share of TTFT; targets: share <= 2%, ITL p99 (b) / P >= 1.5, throughput P / (b) >= 0.9.
#   3. if time is left: P in push mode (layerwise) with the same workload.
# Summary: $OUT/pd_2gpu.md. Usage (repo root; data at ../shared/data or carried as .sd):
#   bash scripts/gpu/pd_2gpu.sh [budget_s=420]
# PD_KILL_ONLY=1: step 1b alone, limit = the budget (300 is plenty); PD_SKIP_KILL=1: without step 1b;
# PD_KILL_MODE=pull|push: step 1b for that mode only (two instances side by side on GPUs 0,1 and 2,3 via
# CUDA_VISIBLE_DEVICES, each with its own OUT)
# CPU dry run of the same logic (fake backend, stories260K, tiny workload): PD_CPU=1 bash <this> 600
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-420}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/pd_2gpu}"; mkdir -p "$out"
pids="$out/bench_pids"; : > "$pids"
kill_all() {  # every process group bench_pd_serving started (its servers run in their own sessions), then ours
  local p; for p in $(cat "$pids" 2>/dev/null); do kill -KILL -- "-$p" 2>/dev/null; done
  for p in $(jobs -p); do kill -KILL -- "-$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
}
trap kill_all EXIT INT TERM
data=../shared/data
if [ -n "${PD_CPU:-}" ]; then
  dev=cpu; backend=fake; model=$data/models/stories260K; tok=""; wl=(--input-len 64 --output-len 16 --num-prompts 8
    --request-rate 8 --warmup 2 --warmup-seconds 1); srv="--max-total-tokens 4096"; gpu_p=""; gpu_d=""; gpu_a=""
else
  dev=cuda; backend=nixl; model=$data/configs/meta-llama--Meta-Llama-3.1-8B; tok="--tokenizer-path $data/tokenizers/llama3"
  wl=(--input-len 1024 --output-len 128 --num-prompts 48 --request-rate 8 --warmup 4)
  # PD_MAX_TOTAL_TOKENS=24576: a pool the 48 requests wrap (~1152 slots each), so the READs per request
  # (printed beside the transfer share) show the allocator's placement after frees, not a fresh pool's
  srv="--load-format dummy --dtype bfloat16 --max-total-tokens ${PD_MAX_TOTAL_TOKENS:-131072} --cuda-graph-max-bs 64"
  gpu_p="--base-gpu-id 0"; gpu_d="--base-gpu-id 1"; gpu_a="--base-gpu-id 0"
fi
declare -A status
finish() { status[$1]="$([ "$2" -eq 0 ] && echo ok || echo "FAILED rc=$2") in $3 s"; }
step() {  # step NAME TIMEOUT_S CMD... : run in the foreground, log to $out/NAME.log
  local name="$1" t="$2"; shift 2
  [ "$t" -lt 10 ] && { status[$name]="skipped (no time left)"; echo "== $name skipped"; return; }
  echo "== $name (timeout ${t}s, at $(( SECONDS - start ))s)"
  local t0=$SECONDS; timeout -k 5 "$t" "$@" > "$out/$name.log" 2>&1; finish "$name" $? $(( SECONDS - t0 ))
  tail -n 12 "$out/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -2
nixl=$("$PY" -c "from sglang.srt.disaggregation.transfer.base import nixl_available as a; print(a())" 2>&1 | tail -1)
nixl_from=$("$PY" -c "import nixl_cu13, os; print(os.path.dirname(nixl_cu13.__file__))" 2>&1 | tail -1)
echo "nixl available: $nixl ($nixl_from)"

# ---- 1. correctness, side by side (small servers: --max-total-tokens 2048) ----
t1=$(( budget * 35 / 100 )); [ "$dev" = cuda ] && [ "$t1" -gt 85 ] && t1=85
# PD_SKIP_CORRECTNESS=1: measurement only (when step 1 already ran on this commit's code in an earlier call)
[ -n "${PD_SKIP_CORRECTNESS:-}${PD_KILL_ONLY:-}" ] && t1=0
export SGLANG_PD_TEST_DEVICE=$dev SGLANG_PD_TEST_BACKEND=$backend SGLANG_PD_TEST_SPLIT_GPUS=1
pt=("$PY" -m pytest -s -q -p no:cacheprovider)
dis=test/integration/test_pd_disaggregation.py
declare -A jobs_=(
  [u_device]="test/unit/test_scheduler_process_device.py"
  [c_pull]="$dis::test_generate_equals_aggregated[pull] $dis::test_streaming_equals_aggregated[pull]"
  [c_push]="$dis::test_generate_equals_aggregated[push] $dis::test_streaming_equals_aggregated[push]"
  [c_layerwise]="test/integration/test_pd_push_layerwise.py::test_layerwise_and_after_the_fact_equal_aggregated")
if [ "$t1" -gt 0 ]; then
echo "== 1. correctness on 2 GPUs + decode kill (timeout ${t1}s each, side by side, at $(( SECONDS - start ))s)"
declare -A jpid
for k in "${!jobs_[@]}"; do
  # shellcheck disable=SC2086
  ( t0=$SECONDS; timeout -k 5 "$t1" "${pt[@]}" ${jobs_[$k]} > "$out/$k.log" 2>&1; echo "$? $(( SECONDS - t0 ))" \
    > "$out/$k.rc" ) &
  jpid[$k]=$!
done
for k in "${!jobs_[@]}"; do wait "${jpid[$k]}"; read -r rc dt < "$out/$k.rc" 2>/dev/null || { rc=99; dt=0; }
  finish "$k" "$rc" "$dt"; echo "-- $k: ${status[$k]}"; grep -h -E "passed|failed|error|\[pd-fault\]" "$out/$k.log" | tail -4
done
else
  echo "== 1. skipped (PD_SKIP_CORRECTNESS / PD_KILL_ONLY)"
fi
# ---- 1b. decode killed mid-transfer, pull and push (3 servers each side by side; its own limit) ----
if [ -z "${PD_SKIP_KILL:-}" ]; then
  tk=${PD_KILL_S:-180}; [ -n "${PD_KILL_ONLY:-}" ] && tk=${PD_KILL_S:-$(( $(left) - 5 ))}
  [ "$tk" -gt $(( $(left) - 5 )) ] && tk=$(( $(left) - 5 ))
  kn=test/integration/test_pd_faults.py::test_decode_killed_mid_transfer
  case "${PD_KILL_MODE:-}" in pull|push) kn="$kn[$PD_KILL_MODE]" ;; "") ;;
    *) echo "PD_KILL_MODE=$PD_KILL_MODE: use pull, push or leave it unset (both)"; exit 2 ;; esac
  step f_decode_kill "$tk" "${pt[@]}" "$kn"
  grep -h -E "\[pd-fault\]|passed|failed" "$out/f_decode_kill.log" | tail -4
fi
unset SGLANG_PD_TEST_SPLIT_GPUS
[ -n "${PD_KILL_ONLY:-}" ] && budget=0  # steps 2 and 3 are skipped (no time left)

[ -n "${PD_KILL_ONLY:-}" ] || for _ in $(seq 1 15); do  # the test servers' GPU memory is back before the measurement (at most 15 s)
  [ "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | wc -l)" -eq 0 ] && break; sleep 1
done
# ---- 2. measurement: P (pull) first, then (b) and (a) on one pair of replicas ----
bench=("$PY" benchmark/disaggregation/bench_pd_serving.py --model-path "$model" $tok --device "$dev" --transfer-backend "$backend"
       --server-extra "$srv" --dataset random "${wl[@]}" --max-concurrency 0 --startup-timeout 150
       --pid-file "$pids")
t2=$(( $(left) - 8 )); [ "$t2" -gt 170 ] && t2=170
step m_pull_agg "$t2" "${bench[@]}" --transfer-mode pull --setups pd agg agg2 --prefill-extra "$gpu_p" \
  --decode-extra "$gpu_d" --agg-extra "$gpu_a" --replica-gpus 0 1 --out-dir "$out/pull"
kill_all; : > "$pids"
# ---- 3. push mode (layerwise) if time is left ----
step m_push $(( $(left) - 5 )) "${bench[@]}" --transfer-mode push --setups pd --prefill-extra "$gpu_p" \
  --decode-extra "$gpu_d" --out-dir "$out/push"
kill_all

{
  echo "# PD across 2 GPUs ($(date -u +%F' '%H:%M) UTC, $("$PY" -c 'import torch
n = torch.cuda.device_count(); print(f"{n} x {torch.cuda.get_device_name(0)}" if n else "no GPU")' 2>&1 | tail -1))"
  echo; echo "device $dev, transfer backend $backend, nixl available: $nixl ($nixl_from); total $(( SECONDS - start )) s"
  echo; echo "| step | status |"; echo "|---|---|"
  for k in u_device c_pull c_push c_layerwise f_decode_kill m_pull_agg m_push; do echo "| $k | ${status[$k]:-not run} |"; done
  echo; for k in u_device c_pull c_push c_layerwise f_decode_kill; do
    grep -h -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)|\[pd-fault\]" "$out/$k.log" 2>/dev/null | sed "s/^/$k: /" | tail -4; done
  echo; grep -h "^\[bench_pd_serving\]" "$out/m_pull_agg.log" "$out/m_push.log" 2>/dev/null | sed 's/^/    /'
  for d in pull push; do f=$(ls "$out/$d"/*_pd_serving_*.md 2>/dev/null | tail -1); [ -n "$f" ] || continue
    echo; echo "## $d"; grep -v "^command:\|^# \|^hardware:\|^$" "$f"; done
  "$PY" - "$out/pull" <<'EOF' 2>&1
import glob, json, sys
fs = sorted(glob.glob(sys.argv[1] + "/*_pd_serving_*.json"))
if fs:
    d = json.load(open(fs[-1])); r, x = d["results"], d.get("transfer") or {}
    print("\n## targets (pull)")
    if x: print(f"- transfer share of TTFT {100 * x['share_of_ttft']:.2f}% (target <= 2%): {'met' if x['share_of_ttft'] <= 0.02 else 'NOT met'}")
    if "pd" in r and "agg2" in r:
        i = r["agg2"]["p99_itl_ms"] / max(r["pd"]["p99_itl_ms"], 1e-9)
        t = r["pd"]["output_throughput"] / max(r["agg2"]["output_throughput"], 1e-9)
        print(f"- ITL p99 (b) / P = {i:.2f} (target >= 1.5): {'met' if i >= 1.5 else 'NOT met'}")
        print(f"- output throughput P / (b) = {t:.2f} (target >= 0.9): {'met' if t >= 0.9 else 'NOT met'}")
EOF
} > "$out/pd_2gpu.md"
for d in pull push; do tail -n 40 "$out/$d"/pd_serving_logs/*.log 2>/dev/null | grep -E "Error|error" | tail -5; done
echo "== summary ($(( SECONDS - start )) s)"; cat "$out/pd_2gpu.md"
