#!/usr/bin/env bash
# Issue 24 item 4 on 4 GPUs: PD disaggregation (KVDirect, NIXL over UCX / CUDA IPC). Budget 200 s on 4 x H100/H200
# (every step under `timeout`, steps continue on failure, every server killed at exit).
#   1. side by side (the equality tests are stories260K servers of --max-total-tokens 2048, tiny next to the 8B ones;
#      they finish while the 8B servers start):
#      e_tp12: test_pd_hetero_tp.py [tp1p1-to-tp2p16-pull]: prefill TP 1 on GPU 0 -> decode TP 2 on GPUs 1,2 (KV heads
#              split across the decode ranks, each reads its heads strided), greedy == aggregated, --disaggregation-verify;
#      e_2p1d: test_pd_two_prefill.py: prefill servers on GPUs 0 and 2, decode on GPU 1, behind mini_lb, greedy ==
#              aggregated, both prefill servers used;
#      m_pd2:  bench_pd_serving pd (prefill GPU 0 -> decode GPU 1), Llama-3.1-8B config dummy bf16, random 1024/128,
#              48 prompts at 8 req/s, pull, with the in-forward READ polling: pure transfer share of TTFT (first READ
#              posted -> last READ DONE) and the decode-side hand-off (RoomReady -> decoding) beside it;
#      m_agg2: the same workload on two aggregated replicas (GPUs 2, 3) behind mini_lb --workers (the same-GPU-count
#              baseline; same card model, other two GPUs of the host, run at the same time as m_pd2).
#   2. short benches, 24 prompts 1024/128 at 8 req/s, pd only (order: ISSUE24_PD4_ORDER, default "tp12 2p1d"):
#      m_tp12: prefill TP 1 (GPU 0) -> decode TP 2 (GPUs 1, 2);  m_2p1d: prefill GPUs 0 and 1 -> decode GPU 2.
#   3. if time is left: m_sharegpt (pd 2-GPU, ShareGPT), m_push (pd 2-GPU, push/layerwise, 1024/128).
# Tables: $OUT/issue24_pd4_*.md; summary at the end. Usage (repo root; data at ../shared/data or carried as .sd):
#   bash scripts/gpu/issue24_pd_4gpu.sh [budget_s=200]
# CPU dry run of the logic (fake backend, stories260K, tiny workload): ISSUE24_PD_CPU=1 bash <this> 900
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-200}"; start=0  # the preamble (wheel install) counts too
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/issue24_pd4}"; mkdir -p "$out"
pids="$out/bench_pids"; : > "$pids"
kill_all() {  # every process group bench_pd_serving started (its servers run in their own sessions), then ours
  local p; for p in $(cat "$pids" 2>/dev/null); do kill -KILL -- "-$p" 2>/dev/null; done
  for p in $(jobs -p); do kill -KILL -- "-$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
}
trap kill_all EXIT INT TERM
data=../shared/data
if [ -n "${ISSUE24_PD_CPU:-}" ]; then
  dev=cpu; backend=fake; model=$data/models/stories260K; tok=(); n_main=8; n_short=6; il=64; ol=16
  srv="--max-total-tokens 4096"; tp2=""; cap=400
else
  dev=cuda; backend=nixl; model=$data/configs/meta-llama--Meta-Llama-3.1-8B; tok=(--tokenizer-path "$data/tokenizers/llama3")
  n_main=48; n_short=24; il=1024; ol=128
  srv="--load-format dummy --dtype bfloat16 --max-total-tokens 131072 --cuda-graph-max-bs 64"; tp2="--tp 2"; cap=110
fi
gpu() { [ "$dev" = cuda ] && echo "--base-gpu-id $1"; }
declare -A status
finish() { status[$1]="$([ "$2" -eq 0 ] && echo ok || echo "FAILED rc=$2") in $3 s"; }
bg() {  # bg NAME TIMEOUT_S CMD... : start in the background, log to $out/NAME.log, rc to $out/NAME.rc
  local name="$1" t="$2"; shift 2
  ( t0=$SECONDS; timeout -k 5 "$t" "$@" > "$out/$name.log" 2>&1; echo "$? $(( SECONDS - t0 ))" > "$out/$name.rc" ) &
  echo $! > "$out/$name.pid"; echo "== $name started (timeout ${t}s, at $(( SECONDS - start ))s)"
}
collect() { local k rc dt; for k in "$@"; do wait "$(cat "$out/$k.pid")" 2>/dev/null
  read -r rc dt < "$out/$k.rc" 2>/dev/null || { rc=99; dt=0; }; finish "$k" "$rc" "$dt"; echo "-- $k: ${status[$k]}"
  grep -h -E "passed|failed|error|transfer share|hand-off share" "$out/$k.log" | tail -4; done; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -4
nixl=$("$PY" -c "from sglang.srt.disaggregation.transfer.base import nixl_available as a; print(a())" 2>&1 | tail -1)
echo "nixl available: $nixl"
bench=("$PY" benchmark/bench_pd_serving.py --model-path "$model" "${tok[@]}" --device "$dev" --transfer-backend "$backend"
       --server-extra "$srv" --max-concurrency 0 --request-rate 8 --warmup 4 --startup-timeout 150 --pid-file "$pids")
rnd=(--dataset random --input-len "$il" --output-len "$ol")

# ---- 1. equality (TP1 -> TP2, 2P:1D) + the 2-GPU pd row and its agg2 baseline, side by side ----
t1=$(( $(left) / 2 )); [ "$t1" -gt "$cap" ] && t1=$cap
pt=("$PY" -m pytest -s -q -p no:cacheprovider)
export SGLANG_PD_TEST_DEVICE=$dev SGLANG_PD_TEST_BACKEND=$backend SGLANG_PD_TEST_SPLIT_GPUS=1
if [ -z "${ISSUE24_PD4_SKIP_EQ:-}" ]; then  # ISSUE24_PD4_SKIP_EQ=1: benches only (CPU dry runs of the logic)
  SGLANG_PD_TEST_PREFILL_GPUS=0,2 bg e_2p1d "$t1" "${pt[@]}" test/integration/test_pd_two_prefill.py
  bg e_tp12 "$t1" "${pt[@]}" "test/integration/test_pd_hetero_tp.py::test_hetero_tp_and_page_size[tp1p1-to-tp2p16-pull]"
fi
unset SGLANG_PD_TEST_SPLIT_GPUS
bg m_pd2 "$t1" "${bench[@]}" "${rnd[@]}" --num-prompts "$n_main" --setups pd --prefill-extra "$(gpu 0)" \
  --decode-extra "$(gpu 1)" --out-dir "$out/pd2"
bg m_agg2 "$t1" "${bench[@]}" "${rnd[@]}" --num-prompts "$n_main" --setups agg2 --replica-gpus 2 3 --out-dir "$out/agg2"
collect m_pd2 m_agg2; [ -z "${ISSUE24_PD4_SKIP_EQ:-}" ] && collect e_2p1d e_tp12
kill_all; : > "$pids"
"$PY" - "$out" <<'EOF' > "$out/issue24_pd4_2gpu.md" 2>&1
import glob, json, sys
o = sys.argv[1]
def load(d):
    fs = sorted(glob.glob(f"{o}/{d}/*_pd_serving_*.json"))
    return json.load(open(fs[-1])) if fs else {}
pd, agg = load("pd2"), load("agg2")
r = {**agg.get("results", {}), **pd.get("results", {})}
x = pd.get("transfer") or {}
print(f"# Issue 24: PD on 2 GPUs (prefill GPU 0 -> decode GPU 1) vs agg2 (replicas on GPUs 2, 3), same call, side by side")
cmd = " ".join(pd.get("command") or agg.get("command") or [])
print(f"\nhardware: {pd.get('hardware') or agg.get('hardware')}\n\ncommand (pd): `{cmd}`\n")
if x:
    print(f"- pure KV transfer (first READ posted -> last READ DONE): {x['mean_ms']:.3f} ms/request, "
          f"{x['bytes_sum'] / max(x['requests'], 1) / 2**20:.1f} MiB, {x['reads_per_request']:.1f} READs; "
          f"**share of TTFT {100 * x['share_of_ttft']:.2f}%** (target <= 2%: {'met' if x['share_of_ttft'] <= 0.02 else 'NOT met'})")
    if "handoff_mean_ms" in x:
        print(f"- decode-side hand-off: RoomReady -> first READ {x['setup_mean_ms']:.3f} ms, last READ DONE -> decoding "
              f"{x['wait_mean_ms']:.3f} ms, RoomReady -> decoding {x['handoff_mean_ms']:.3f} ms "
              f"({100 * x['handoff_share_of_ttft']:.2f}% of TTFT)")
if "pd" in r and "agg2" in r:
    print("\n| metric | agg2 | pd | pd / agg2 |\n|---|---|---|---|")
    for m in ["mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
              "p99_itl_ms", "output_throughput", "completed"]:
        a, p = r["agg2"].get(m, float("nan")), r["pd"].get(m, float("nan"))
        print(f"| {m} | {a:.3f} | {p:.3f} | {p / a if a else float('nan'):.3f} |")
    i = r["agg2"]["p99_itl_ms"] / max(r["pd"]["p99_itl_ms"], 1e-9)
    t = r["pd"]["output_throughput"] / max(r["agg2"]["output_throughput"], 1e-9)
    print(f"\n- ITL p99 agg2 / pd = {i:.2f} (target >= 1.5); output throughput pd / agg2 = {t:.2f} (target >= 0.9)")
for k, v in {**agg.get("errors", {}), **pd.get("errors", {})}.items():
    print(f"\n**{k} failed**: {v[-400:]}")
EOF

# ---- 2. 4-GPU layouts: short pd benches ----
for row in ${ISSUE24_PD4_ORDER:-tp12 2p1d}; do
  t=$(( $(left) - 10 )); [ "$t" -gt "$cap" ] && t=$cap
  [ "$t" -lt 45 ] && { status[m_$row]="skipped (no time left)"; continue; }
  if [ "$row" = tp12 ]; then lay=(--prefill-extra "$(gpu 0)" --decode-extra "$(gpu 1) $tp2")
  else lay=(--prefill-gpus 0 1 --decode-extra "$(gpu 2)"); fi
  bg "m_$row" "$t" "${bench[@]}" "${rnd[@]}" --num-prompts "$n_short" --setups pd "${lay[@]}" --out-dir "$out/$row"
  collect "m_$row"; kill_all; : > "$pids"
  f=$(ls "$out/$row"/*_pd_serving_*.md 2>/dev/null | tail -1)
  [ -n "$f" ] && { echo "# Issue 24: PD layout $row (tp12: prefill TP1 GPU 0 -> decode TP2 GPUs 1,2; 2p1d: prefill GPUs 0,1 -> decode GPU 2)"; echo; cat "$f"; } > "$out/issue24_pd4_$row.md"
done
# ---- 3. optional rows on 2 GPUs ----
t=$(( $(left) - 8 ))
if [ "$t" -ge 50 ]; then
  bg m_sharegpt "$t" "${bench[@]}" --dataset sharegpt --num-prompts "$n_main" --output-len "$ol" --setups pd \
    --prefill-extra "$(gpu 0)" --decode-extra "$(gpu 1)" --out-dir "$out/sharegpt"
  collect m_sharegpt; kill_all; : > "$pids"
  f=$(ls "$out/sharegpt"/*_pd_serving_*.md 2>/dev/null | tail -1); [ -n "$f" ] && cp "$f" "$out/issue24_pd4_sharegpt.md"
else status[m_sharegpt]="skipped (no time left)"; fi
t=$(( $(left) - 5 ))
if [ "$t" -ge 50 ]; then
  bg m_push "$t" "${bench[@]}" "${rnd[@]}" --num-prompts "$n_short" --transfer-mode push --setups pd \
    --prefill-extra "$(gpu 0)" --decode-extra "$(gpu 1)" --out-dir "$out/push"
  collect m_push; kill_all
  f=$(ls "$out/push"/*_pd_serving_*.md 2>/dev/null | tail -1); [ -n "$f" ] && cp "$f" "$out/issue24_pd4_push.md"
else status[m_push]="skipped (no time left)"; fi

{
  echo "# Issue 24 item 4 on 4 GPUs ($(date -u +%F' '%H:%M) UTC, $("$PY" -c 'import torch
n = torch.cuda.device_count(); print(f"{n} x {torch.cuda.get_device_name(0)}" if n else "no GPU")' 2>&1 | tail -1))"
  echo; echo "device $dev, backend $backend, nixl available: $nixl; total $(( SECONDS - start )) s of $budget"
  echo; echo "| step | status |"; echo "|---|---|"
  for k in e_tp12 e_2p1d m_pd2 m_agg2 m_tp12 m_2p1d m_sharegpt m_push; do echo "| $k | ${status[$k]:-not run} |"; done
  for k in e_tp12 e_2p1d; do grep -h -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$out/$k.log" 2>/dev/null | sed "s/^/$k: /" | tail -3; done
  echo; cat "$out/issue24_pd4_2gpu.md"
  for k in tp12 2p1d sharegpt push; do [ -f "$out/issue24_pd4_$k.md" ] || continue; echo; echo "## $k"
    grep -v "^command:\|^# \|^hardware:\|^$" "$out/issue24_pd4_$k.md"; done
} > "$out/issue24_pd4_summary.md"
for k in m_pd2 m_agg2 m_tp12 m_2p1d; do grep -h -E "Error|error" "$out/$k.log" 2>/dev/null | tail -3; done
echo "== summary ($(( SECONDS - start )) s)"; cat "$out/issue24_pd4_summary.md"
