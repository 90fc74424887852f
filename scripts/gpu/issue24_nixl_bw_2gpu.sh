#!/usr/bin/env bash
# Issue 24: why does a 1K-token KV pull (128 MiB, 64 READs, GPU 0 -> GPU 1) take 2.2 ms (~58 GB/s) when NVLink
# moves several hundred GB/s? Budget 150 s on 2 GPUs (every step under `timeout`, steps continue on failure):
#   0. GPU topology (NVLink?) and the carried nixl wheel (device_preamble.sh installs .whl/).
#   1. benchmark/bench_nixl_read.py: agent A (GPU 0) / agent B (GPU 1) in two processes per UCX setting, READ of
#      128 MiB split as 1 / 8 / 64 / 512 descriptors in ONE NIXL request: our NixlTransferBackend.read ("ours"),
#      one prepared request re-posted ("repost"), WRITE ("write"); settings: default (NIXL/UCX defaults), ours
#      (+ the transport's UCX_ENV_DEFAULTS), tls (UCX_TLS=cuda_ipc,cuda_copy,tcp,self), threads4 (4 dedicated UCX
#      workers, a request's descriptors split over them), getzc_off, sgl (NIXL_UCX_SGL_ENABLE=1), no_ipc (UCX_TLS=^cuda_ipc: what a host-staged path gives); the UCX protocol
#      table (UCX_PROTO_INFO=y: which transport serves ucp_get / ucp_put) per setting; floor: torch copy_
#      GPU 0 -> GPU 1 of the same bytes (CUDA events), 1 and 512 chunks. Bytes checked before timing.
#   2. if time is left: bench_pd_serving.py pd only (1P1D, Llama-3.1-8B config, dummy bf16, random 1024/128,
#      24 prompts at 8 req/s) under the best setting of step 1 (64 descriptors, "ours" path: its UCX env, and
#      --disaggregation-nixl-threads for threads4): transfer share of TTFT.
# Summary: $OUT/issue24_nixl_bw.md. Usage (repo root): bash scripts/gpu/issue24_nixl_bw_2gpu.sh [budget_s=150]
# CPU dry run of the same logic (host memory, 8 MiB, no floor, no serving row): ISSUE24_NIXL_BW_CPU=1 bash <this>
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-150}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/issue24_nixl_bw}"; mkdir -p "$out"
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

# ---- 1. NIXL READ microbenchmark (getzc_off, no_ipc last: an emulated READ may be slow) ----
bw_t=$(( $(left) / 2 )); [ "$bw_t" -gt 80 ] && bw_t=80
dev=(--device cuda --mib 128); [ -n "${ISSUE24_NIXL_BW_CPU:-}" ] && dev=(--device cpu --mib 8)
step bw "$bw_t" "$PY" benchmark/bench_nixl_read.py "${dev[@]}" \
  --descs 1 8 64 512 --iters 12 --warmup 2 --write --timeout 22 --out-dir "$out" \
  --settings ours default tls threads4 sgl getzc_off no_ipc
grep -E "^\[bench|Error" "$out/bw.log" | head -20

# ---- 2. PD serving row under the best setting ----
data=../shared/data
best=$("$PY" benchmark/bench_nixl_read.py --best-env "$out/issue24_nixl_read.json" 2>/dev/null)
flags=$("$PY" benchmark/bench_nixl_read.py --best-env "$out/issue24_nixl_read.json" --best-flags 2>/dev/null)
echo "best setting: env ${best:-<transport defaults>}, decode flags ${flags:-<none>}"
t2=$(( $(left) - 6 )); [ -n "${ISSUE24_NIXL_BW_CPU:-}" ] && t2=0
# shellcheck disable=SC2046
step pd "$t2" env $best "$PY" benchmark/bench_pd_serving.py \
  --model-path $data/configs/meta-llama--Meta-Llama-3.1-8B --tokenizer-path $data/tokenizers/llama3 --device cuda \
  --transfer-backend nixl --transfer-mode pull --setups pd --prefill-extra "--base-gpu-id 0" \
  --decode-extra "--base-gpu-id 1 $flags" --server-extra "--load-format dummy --dtype bfloat16 --max-total-tokens 65536 \
--cuda-graph-max-bs 32" --dataset random --input-len 1024 --output-len 128 --num-prompts 24 --request-rate 8 \
  --warmup 2 --max-concurrency 0 --startup-timeout $(( t2 > 30 ? t2 - 25 : 10 )) --pid-file "$pids" --out-dir "$out/pd"
kill_all

{
  echo "# Issue 24: NIXL READ bandwidth GPU 0 -> GPU 1 ($(date -u +%F' '%H:%M) UTC; total $(( SECONDS - start )) s)"
  echo; echo '```'; cat "$out/env.log"; echo '```'
  echo; echo "| step | status |"; echo "|---|---|"
  for k in bw pd; do echo "| $k | ${status[$k]:-not run} |"; done
  echo; sed -n '/^| setting/,$p' "$out/issue24_nixl_read.md" 2>/dev/null
  echo; echo "## PD serving, 1P1D, random 1024/128, 24 prompts at 8 req/s (env: ${best:-transport defaults}; decode ${flags:-default flags})"
  f=$(ls "$out"/pd/*_pd_serving_*.md 2>/dev/null | tail -1)
  [ -n "$f" ] && grep -v "^# \|^hardware:\|^$" "$f" || tail -n 8 "$out/pd.log" 2>/dev/null
} > "$out/issue24_nixl_bw.md"
echo "== summary ($(( SECONDS - start )) s)"; cat "$out/issue24_nixl_bw.md"
