#!/usr/bin/env bash
# Per-descriptor cost of NIXL/UCX transfers GPU 0 -> GPU 1 (2026-11-27, 4 x H200: a 128 MiB READ is 0.58 ms as
# 1 descriptor, 1.21 ms as 64, 5.1 ms as 512; UCX's cuda_ipc zero-copy get, so ~10 us per descriptor, not bandwidth).
# Budget 100 s on 2 GPUs (every step under `timeout`, steps continue on failure):
#   0. GPU topology (NVLink?) and the carried nixl wheel (device_preamble.sh installs .whl/).
#   1. benchmark/disaggregation/bench_nixl_read.py: agent A (GPU 0) / agent B (GPU 1) in two processes per setting, 128 MiB as
#      1 / 8 / 64 / 512 descriptors in ONE NIXL request: READ ("ours", "repost") and WRITE ("write"; the written
#      bytes are read back and checked, X if wrong). Settings: ours (the transport's defaults, now with
#      NIXL_UCX_SGL_ENABLE=1: WRITEs as one UCX scatter-gather list), sgl_off (the same without it: the WRITE A/B),
#      tls (UCX_TLS=cuda_ipc,cuda_copy,tcp,self: fastest READ at 512 on 2026-11-27), rails1 (UCX_MAX_RMA_RAILS=1),
#      workers2 (a 2nd UCX worker, no threads) and threads4 (4 dedicated UCX threads; the 2026-11-27 run hung in its FIRST
#      1-descriptor READ, which is not split: workers2 tells whether the multi-worker UCX context or the threads do
#      it; a hang now prints the initiator's progress marks and Python stack in the ERROR row). Floor: torch copy_.
#   2. only when >= 70 s are left: benchmark/disaggregation/bench_pd_serving.py pd (1P1D, Llama-3.1-8B config, dummy bf16, random 1024/128,
#      24 prompts at 8 req/s) under the best READ setting of step 1 (64 descriptors).
# Summary: $OUT/nixl_bandwidth.md. Usage (repo root): bash scripts/gpu/nixl_bandwidth_2gpu.sh [budget_s=100]
# CPU dry run of the same logic (host memory, 8 MiB, no floor, no serving row): NIXL_BW_CPU=1 bash <this>
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-100}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/nixl_bandwidth}"; mkdir -p "$out"
pids="$out/bench_pids"; : > "$pids"
kill_all() {  # the process groups bench_pd_serving started (its servers run in their own sessions), then ours
  local p; for p in $(cat "$pids" 2>/dev/null); do kill -KILL -- "-$p" 2>/dev/null; done
  for p in $(jobs -p); do kill -KILL "$p" 2>/dev/null; done
}
trap kill_all EXIT INT TERM
declare -A status
step() {  # step NAME TIMEOUT_S CMD...: foreground, log to $out/NAME.log
  local name="$1" t="$2"; shift 2
  [ "$t" -lt 10 ] && { status[$name]="skipped (no time left)"; echo "== $name skipped"; return 1; }
  echo "== $name (timeout ${t}s, at $(( SECONDS - start ))s)"
  local t0=$SECONDS rc; timeout -k 5 "$t" "$@" > "$out/$name.log" 2>&1; rc=$?
  status[$name]="$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc") in $(( SECONDS - t0 )) s"; return $rc
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -2; nvidia-smi topo -m 2>&1 | head -4
  "$PY" -c "import nixl_cu13, os; print('nixl from', os.path.dirname(nixl_cu13.__file__))" 2>&1 | tail -1
} | tee "$out/env.log"

# ---- 1. NIXL READ/WRITE microbenchmark (the settings that hung before last) ----
bw_t=$(( $(left) - 8 )); [ "$bw_t" -gt 90 ] && bw_t=90
dev=(--device cuda --mib 128); [ -n "${NIXL_BW_CPU:-}" ] && dev=(--device cpu --mib 8)
step bw "$bw_t" "$PY" benchmark/disaggregation/bench_nixl_read.py "${dev[@]}" \
  --descs 1 8 64 512 --iters 12 --warmup 2 --write --timeout 16 --out-dir "$out" \
  --settings ours sgl_off tls rails1 workers2 threads4
grep -E "^\[bench|Error" "$out/bw.log" | head -20

# ---- 2. PD serving row under the best setting ----
data=../shared/data
rows=$(ls "$out"/*_nixl_read.json 2>/dev/null | tail -1)  # the JSON bench_nixl_read.py wrote
best=$("$PY" benchmark/disaggregation/bench_nixl_read.py --best-env "$rows" 2>/dev/null)
flags=$("$PY" benchmark/disaggregation/bench_nixl_read.py --best-env "$rows" --best-flags 2>/dev/null)
echo "best setting: env ${best:-<transport defaults>}, decode flags ${flags:-<none>}"
t2=$(( $(left) - 6 )); [ "$t2" -lt 64 ] && t2=0; [ -n "${NIXL_BW_CPU:-}" ] && t2=0
# shellcheck disable=SC2046
step pd "$t2" env $best "$PY" benchmark/disaggregation/bench_pd_serving.py \
  --model-path $data/configs/meta-llama--Meta-Llama-3.1-8B --tokenizer-path $data/tokenizers/llama3 --device cuda \
  --transfer-backend nixl --transfer-mode pull --setups pd --prefill-extra "--base-gpu-id 0" \
  --decode-extra "--base-gpu-id 1 $flags" --server-extra "--load-format dummy --dtype bfloat16 --max-total-tokens 65536 \
--cuda-graph-max-bs 32" --dataset random --input-len 1024 --output-len 128 --num-prompts 24 --request-rate 8 \
  --warmup 2 --max-concurrency 0 --startup-timeout $(( t2 > 30 ? t2 - 25 : 10 )) --pid-file "$pids" --out-dir "$out/pd"
kill_all

{
  echo "# NIXL READ bandwidth GPU 0 -> GPU 1 ($(date -u +%F' '%H:%M) UTC; total $(( SECONDS - start )) s)"
  echo; echo '```'; cat "$out/env.log"; echo '```'
  echo; echo "| step | status |"; echo "|---|---|"
  for k in bw pd; do echo "| $k | ${status[$k]:-not run} |"; done
  echo; sed -n '/^| setting/,$p' "${rows%.json}.md" 2>/dev/null
  echo; echo "## PD serving, 1P1D, random 1024/128, 24 prompts at 8 req/s (env: ${best:-transport defaults}; decode ${flags:-default flags})"
  f=$(ls "$out"/pd/*_pd_serving_*.md 2>/dev/null | tail -1)
  [ -n "$f" ] && grep -v "^# \|^hardware:\|^$" "$f" || tail -n 8 "$out/pd.log" 2>/dev/null
} > "$out/nixl_bandwidth.md"
echo "== summary ($(( SECONDS - start )) s)"; cat "$out/nixl_bandwidth.md"
