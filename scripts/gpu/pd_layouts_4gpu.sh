#!/usr/bin/env bash
# PD layouts on 4 GPUs: PD disaggregation (KVDirect, NIXL over UCX / CUDA IPC). Budget 220 s on 4 x H100/H200
# (every step under `timeout`, steps continue on failure, every server killed at exit). Steps run one after the
# other (nothing side by side with the equality tests, so their timings are their own):
#   1. equality (stories260K, pytest -s -v: timestamped progress lines; SGLANG_PD_TEST_TIMEOUT < the step's timeout,
#      so a slow/hung test fails with its stack and stops its servers; the test servers' log tails are kept):
#      e_tp12: test_pd_hetero_tp.py [tp1p1-to-tp2p16-pull]: prefill TP 1 on GPU 0 -> decode TP 2 on GPUs 1,2 (staged
#              pull: each decode rank reads whole prefill rows, coalesced, and copies its heads), greedy == aggregated,
#              --disaggregation-verify, READs per request coalesced (<= 2 per layer, K/V and decode rank);
#      e_2p1d: test_pd_two_prefill.py: prefill servers on GPUs 0 and 2, decode on GPU 1, behind mini_lb, greedy ==
#              aggregated, both prefill servers used.
#   2. m_tp12: bench_pd_serving pd, prefill TP 1 (GPU 0) -> decode TP 2 (GPUs 1, 2), Llama-3.1-8B config dummy bf16,
#      random 1024/128, 24 prompts at 8 req/s, pull: TTFT/TPOT/ITL, READs per request, pure transfer share of TTFT.
#   3. m_2p1d: the same with prefill GPUs 0 and 1 -> decode GPU 2.
#   4. if time is left: ShareGPT on 2 GPUs, pd (prefill GPU 0 -> decode GPU 1) and its agg2 baseline (replicas on
#      GPUs 2, 3 behind mini_lb), side by side (same card model, other two GPUs of the host).
# Tables: $OUT/pd4_*.md; summary at the end. Usage (repo root; data at ../shared/data or carried as .sd):
#   bash scripts/gpu/pd_layouts_4gpu.sh [budget_s=220]
# PD4_SKIP_EQ=1: no step 1; PD4_EQ="e_tp12": only the named equality tests of step 1 (default both);
# PD4_ORDER="tp12 2p1d": the rows of steps 2-3; PD4_SKIP_SG=1: no step 4 (its agg2 sits on other GPUs).
# CPU dry run of the logic (fake backend, stories260K, tiny workload): PD_CPU=1 bash <this> 900
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-220}"; start=0  # the preamble (wheel install) counts too
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/pd_layouts_4gpu}"; mkdir -p "$out"
pids="$out/bench_pids"; : > "$pids"
kill_all() {  # every process group bench_pd_serving started (its servers run in their own sessions), then ours
  local p; for p in $(cat "$pids" 2>/dev/null); do kill -KILL -- "-$p" 2>/dev/null; done
  for p in $(jobs -p); do kill -KILL -- "-$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
}
trap kill_all EXIT INT TERM
data=../shared/data
if [ -n "${PD_CPU:-}" ]; then
  dev=cpu; backend=fake; model=$data/models/stories260K; tok=(); n_main=8; n_short=6; il=64; ol=16
  srv="--max-total-tokens 4096"; tp2="--tp 2"; cap=300; eq_tp12=300; eq_2p1d=300
else
  dev=cuda; backend=nixl; model=$data/configs/meta-llama--Meta-Llama-3.1-8B; tok=(--tokenizer-path "$data/tokenizers/llama3")
  n_main=48; n_short=24; il=1024; ol=128
  srv="--load-format dummy --dtype bfloat16 --max-total-tokens 131072 --cuda-graph-max-bs 64"; tp2="--tp 2"; cap=110
  eq_tp12=70; eq_2p1d=65  # stories260K servers start in parallel inside each test (CUDA init + small graphs)
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
  grep -h -E "passed|failed|error|transfer share|hand-off share|pd-test" "$out/$k.log" | tail -12; done; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -4
nixl=$("$PY" -c "from sglang.srt.disaggregation.transfer.base import nixl_available as a; print(a())" 2>&1 | tail -1)
echo "nixl available: $nixl"
bench=("$PY" benchmark/disaggregation/bench_pd_serving.py --model-path "$model" "${tok[@]}" --device "$dev" --transfer-backend "$backend"
       --server-extra "$srv" --max-concurrency 0 --request-rate 8 --warmup 4 --pid-file "$pids")
rnd=(--dataset random --input-len "$il" --output-len "$ol")

# ---- 1. equality, one test after the other, each bounded ----
eq() {  # eq NAME CAP_S PYTEST_ARGS... (env set by the caller)
  local name="$1" t="$2"; shift 2
  local l=$(( $(left) - 85 )); [ "$l" -lt "$t" ] && t=$l  # keep >= 85 s for the tp12 row
  [ "$t" -lt 30 ] && { status[$name]="skipped (no time left)"; return; }
  touch "$out/$name.mark"
  SGLANG_PD_TEST_TIMEOUT=$(( t - 8 )) bg "$name" "$t" "$PY" -m pytest -s -v -p no:cacheprovider "$@"
  collect "$name"; kill_all
  local f; for f in $(find /tmp -maxdepth 1 -name 'sglang-test-server-*.log' -newer "$out/$name.mark" 2>/dev/null); do
    echo "==== $f"; tail -25 "$f"; done > "$out/$name.servers.log"
}
export SGLANG_PD_TEST_DEVICE=$dev SGLANG_PD_TEST_BACKEND=$backend
eqs=" ${PD4_EQ:-e_tp12 e_2p1d} "
if [ -z "${PD4_SKIP_EQ:-}" ]; then  # PD4_SKIP_EQ=1: benches only
  [[ $eqs == *" e_tp12 "* ]] && SGLANG_PD_TEST_SPLIT_GPUS=1 eq e_tp12 "$eq_tp12" \
    "test/integration/test_pd_hetero_tp.py::test_hetero_tp_and_page_size[tp1p1-to-tp2p16-pull]"
  [[ $eqs == *" e_2p1d "* ]] && SGLANG_PD_TEST_SPLIT_GPUS=1 SGLANG_PD_TEST_PREFILL_GPUS=0,2 eq e_2p1d "$eq_2p1d" \
    test/integration/test_pd_two_prefill.py
fi

table() {  # table PD_DIR [AGG2_DIR] TITLE: the transfer facts and, with a baseline, the pd / agg2 table
  "$PY" - "$out" "$@" <<'EOF'
import glob, json, sys
o, pd_dir, agg_dir, title = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
def load(d):
    fs = sorted(glob.glob(f"{o}/{d}/*_pd_serving_*.json")) if d else []
    return json.load(open(fs[-1])) if fs else {}
pd, agg = load(pd_dir), load(agg_dir)
r = {**agg.get("results", {}), **pd.get("results", {})}
x = pd.get("transfer") or {}
print(f"# PD: {title}")
print(f"\nhardware: {pd.get('hardware') or agg.get('hardware')}\n\ncommand (pd): `{' '.join(pd.get('command') or [])}`\n")
if x:
    print(f"- pure KV transfer (first READ posted -> last READ DONE): {x['mean_ms']:.3f} ms/request, "
          f"{x['bytes_sum'] / max(x['requests'], 1) / 2**20:.1f} MiB, {x['reads_per_request']:.1f} READs; "
          f"**share of TTFT {100 * x['share_of_ttft']:.2f}%** (target <= 2%: {'met' if x['share_of_ttft'] <= 0.02 else 'NOT met'})")
    if "handoff_mean_ms" in x:
        print(f"- decode-side hand-off: RoomReady -> first READ {x['setup_mean_ms']:.3f} ms, last READ DONE -> decoding "
              f"{x['wait_mean_ms']:.3f} ms, RoomReady -> decoding {x['handoff_mean_ms']:.3f} ms "
              f"({100 * x['handoff_share_of_ttft']:.2f}% of TTFT)")
ms = ["mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms",
      "output_throughput", "completed"]
if "pd" in r and "agg2" in r:
    print("\n| metric | agg2 | pd | pd / agg2 |\n|---|---|---|---|")
    for m in ms:
        a, p = r["agg2"].get(m, float("nan")), r["pd"].get(m, float("nan"))
        print(f"| {m} | {a:.3f} | {p:.3f} | {p / a if a else float('nan'):.3f} |")
    i = r["agg2"]["p99_itl_ms"] / max(r["pd"]["p99_itl_ms"], 1e-9)
    t = r["pd"]["output_throughput"] / max(r["agg2"]["output_throughput"], 1e-9)
    print(f"\n- ITL p99 agg2 / pd = {i:.2f} (target >= 1.5); output throughput pd / agg2 = {t:.2f} (target >= 0.9)")
elif "pd" in r:
    print("\n| metric | pd |\n|---|---|")
    for m in ms:
        print(f"| {m} | {r['pd'].get(m, float('nan')):.3f} |")
for k, v in {**agg.get("errors", {}), **pd.get("errors", {})}.items():
    print(f"\n**{k} failed**: {v[-400:]}")
EOF
}

# ---- 2-3. 4-GPU layouts: short pd benches ----
for row in ${PD4_ORDER:-tp12 2p1d}; do
  t=$(( $(left) - 5 )); [ "$t" -gt "$cap" ] && t=$cap
  [ "$t" -lt 45 ] && { status[m_$row]="skipped (no time left)"; continue; }
  if [ "$row" = tp12 ]; then lay=(--prefill-extra "$(gpu 0)" --decode-extra "$(gpu 1) $tp2")
  else lay=(--prefill-gpus 0 1 --decode-extra "$(gpu 2)"); fi
  bg "m_$row" "$t" "${bench[@]}" --startup-timeout $(( t - 15 )) "${rnd[@]}" --num-prompts "$n_short" --setups pd \
    "${lay[@]}" --out-dir "$out/$row"
  collect "m_$row"; kill_all; : > "$pids"
  table "$row" "" "PD layout $row (tp12: prefill TP1 GPU 0 -> decode TP2 GPUs 1,2; 2p1d: prefill GPUs 0,1 -> decode GPU 2)" \
    > "$out/pd4_$row.md" 2>&1
done
# ---- 4. ShareGPT on 2 GPUs (pd) beside its agg2 baseline (GPUs 2, 3), if time is left ----
t=$(( $(left) - 8 )); [ -n "${PD4_SKIP_SG:-}" ] && t=0
if [ "$t" -ge 60 ]; then
  sg=(--dataset sharegpt --num-prompts "$n_main" --output-len "$ol" --startup-timeout $(( t - 20 )))
  bg m_sg_pd "$t" "${bench[@]}" "${sg[@]}" --setups pd --prefill-extra "$(gpu 0)" --decode-extra "$(gpu 1)" \
    --out-dir "$out/sg_pd"
  bg m_sg_agg2 "$t" "${bench[@]}" "${sg[@]}" --setups agg2 --replica-gpus 2 3 --out-dir "$out/sg_agg2"
  collect m_sg_pd m_sg_agg2; kill_all; : > "$pids"
  table sg_pd sg_agg2 "ShareGPT, PD on 2 GPUs (prefill GPU 0 -> decode GPU 1) vs agg2 (replicas on GPUs 2, 3), same call" \
    > "$out/pd4_sharegpt.md" 2>&1
else status[m_sg_pd]="skipped (no time left)"; fi

{
  echo "# PD layouts on 4 GPUs ($(date -u +%F' '%H:%M) UTC, $("$PY" -c 'import torch
n = torch.cuda.device_count(); print(f"{n} x {torch.cuda.get_device_name(0)}" if n else "no GPU")' 2>&1 | tail -1))"
  echo; echo "device $dev, backend $backend, nixl available: $nixl; total $(( SECONDS - start )) s of $budget"
  echo; echo "| step | status |"; echo "|---|---|"
  for k in e_tp12 e_2p1d m_tp12 m_2p1d m_sg_pd m_sg_agg2; do echo "| $k | ${status[$k]:-not run} |"; done
  for k in e_tp12 e_2p1d; do grep -h -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)|Timeout" "$out/$k.log" 2>/dev/null \
    | sed "s/^/$k: /" | tail -3; done
  for k in tp12 2p1d sharegpt; do [ -f "$out/pd4_$k.md" ] || continue; echo; echo "## $k"
    grep -v "^command\|^# \|^hardware:\|^$" "$out/pd4_$k.md"; done
} > "$out/pd4_summary.md"
for k in m_tp12 m_2p1d m_sg_pd m_sg_agg2; do grep -h -E "Error|error" "$out/$k.log" 2>/dev/null | tail -3; done
echo "== summary ($(( SECONDS - start )) s)"; cat "$out/pd4_summary.md"
