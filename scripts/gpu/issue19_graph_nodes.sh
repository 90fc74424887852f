#!/usr/bin/env bash
# Issue 19 A/B of the two graph-node switches (both default off) on one H100/H200, one device call (<= 9 minutes):
#   SGLANG_DECODE_FUSED_REDUCE=1  fused split reduce in the decode attention kernel (no reduce launch per layer)
#   SGLANG_GRAPH_GREEDY=1         argmax captured in the decode CUDA graph (sampler skipped for all-greedy batches)
#   1. GPU tests: fused reduce (vs torch_native and the two-launch path, 200 CUDA-graph replays bit-identical,
#      counters back at zero), the decode split-rule / graph-replay tests, graph-greedy ids == sampler ids.
#   2. bench_gpu_targets --only floors,decode: both OFF, fused reduce ON, both ON (same machine, same run);
#      a summary table (each run's step vs the floor of its own run).
# Usage (repo root): bash scripts/gpu/issue19_graph_nodes.sh      Writes under $OUT (default /tmp/out):
#   issue19_fr_run.log, issue19_fr_pytest.log, {off,fr,both}/<date>_gpu_targets.{md,json}
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
if [[ -f scripts/gpu/device_preamble.sh ]]; then source scripts/gpu/device_preamble.sh; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$root/python:$root/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET SGLANG_TRITON_DECODE_LEGACY SGLANG_DECODE_FUSED_REDUCE SGLANG_GRAPH_GREEDY
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT/off" "$OUT/fr" "$OUT/both"
PY="${PYTHON:-python3}"
exec > >(tee -a "$OUT/issue19_fr_run.log") 2>&1
t_start=$(date +%s)
stage() { echo; echo "== $1 ($(( $(date +%s) - t_start )) s elapsed)"; }

stage "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true

stage "1. GPU tests (fused split reduce, split rules, graph replay, graph greedy)"
timeout -k 10 120 $PY -m pytest -q -p no:cacheprovider test/gpu/test_triton_kernels_gpu.py -m gpu \
  -k "fused_split_reduce or split_rules or cuda_graph_replay or decode_vs_torch_native" > "$OUT/issue19_fr_pytest.log" 2>&1
rc_tests=$?
timeout -k 10 90 $PY -m pytest -q -p no:cacheprovider test/gpu/test_gpu_correctness.py -m gpu \
  -k "graph_greedy or cuda_graph_replay_equals_eager" >> "$OUT/issue19_fr_pytest.log" 2>&1
rc_tests=$(( rc_tests || $? ))
tail -n 15 "$OUT/issue19_fr_pytest.log"

stage "2a. floors + decode, both switches OFF (defaults)"
timeout -k 10 100 $PY benchmark/bench_gpu_targets.py --only floors,decode --skip-serving \
  --out "$OUT/off" --time-budget-s 95 2>&1 | grep -v "^\s*$" | tail -n 12
rc_off=${PIPESTATUS[0]}

stage "2b. floors + decode, SGLANG_DECODE_FUSED_REDUCE=1"
SGLANG_DECODE_FUSED_REDUCE=1 timeout -k 10 100 $PY benchmark/bench_gpu_targets.py --only floors,decode --skip-serving \
  --out "$OUT/fr" --time-budget-s 95 2>&1 | grep -v "^\s*$" | tail -n 12
rc_fr=${PIPESTATUS[0]}

stage "2c. floors + decode, SGLANG_DECODE_FUSED_REDUCE=1 SGLANG_GRAPH_GREEDY=1"
SGLANG_DECODE_FUSED_REDUCE=1 SGLANG_GRAPH_GREEDY=1 timeout -k 10 100 $PY benchmark/bench_gpu_targets.py \
  --only floors,decode --skip-serving --out "$OUT/both" --time-budget-s 95 2>&1 | grep -v "^\s*$" | tail -n 12
rc_both=${PIPESTATUS[0]}

stage "3. summary: decode step per switch setting (each vs the floor of its own run)"
$PY - "$OUT" <<'PYEOF'
import glob, json, sys
out = sys.argv[1]
def load(sub):
    f = sorted(glob.glob(f"{out}/{sub}/*_gpu_targets.json"))
    return {d["batch"]: d for d in (json.load(open(f[-1])) if f else {}).get("parts", {}).get("decode", {}).get("batches", [])}
runs = {k: load(k) for k in ("off", "fr", "both")}
print("| batch | off step (ms) | fused reduce (ms) | + graph greedy (ms) | off / floor | fr / floor | both / floor | target |")
print("|---:|---:|---:|---:|---:|---:|---:|---|")
for bs in sorted(set().union(*runs.values())):
    d = [runs[k].get(bs, {}) for k in ("off", "fr", "both")]
    g = lambda x: f"{x['median_step_s'] * 1e3:.3f}" if x.get("median_step_s") else "n/a"
    r = lambda x: f"{x['median_step_s'] / x['floor_s']:.3f}" if x.get("median_step_s") and x.get("floor_s") else "n/a"
    print(f"| {bs} | {g(d[0])} | {g(d[1])} | {g(d[2])} | {r(d[0])} | {r(d[1])} | {r(d[2])} | <= 1.30 |")
PYEOF
echo "issue19 graph nodes: tests rc=$rc_tests off rc=$rc_off fr rc=$rc_fr both rc=$rc_both; total $(( $(date +%s) - t_start )) s"
find "$OUT" -type f | sort
exit $(( rc_tests || rc_off || rc_fr || rc_both ))
