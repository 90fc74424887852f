#!/usr/bin/env bash
# Issue 19 A/B of SGLANG_DECODE_FUSED_REDUCE (fused split reduce in the decode kernel; default off) on one H100/H200,
# one device call (<= 8 minutes):
#   1. GPU tests of the fused reduce (vs torch_native and the two-launch path, 200 CUDA-graph replays bit-identical,
#      counters back at zero) and the existing decode split-rule / graph-replay tests.
#   2. bench_gpu_targets --only floors,decode with the switch OFF, then ON (same machine, same run); a summary table.
# Usage (repo root): bash scripts/gpu/issue19_fused_reduce.sh      Writes under $OUT (default /tmp/out):
#   issue19_fr_run.log, issue19_fr_pytest.log, off/<date>_gpu_targets.{md,json}, on/<date>_gpu_targets.{md,json}
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
if [[ -f scripts/gpu/device_preamble.sh ]]; then source scripts/gpu/device_preamble.sh; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$root/python:$root/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET SGLANG_TRITON_DECODE_LEGACY SGLANG_DECODE_FUSED_REDUCE
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT/off" "$OUT/on"
PY="${PYTHON:-python3}"
exec > >(tee -a "$OUT/issue19_fr_run.log") 2>&1
t_start=$(date +%s)
stage() { echo; echo "== $1 ($(( $(date +%s) - t_start )) s elapsed)"; }

stage "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true

stage "1. GPU tests (fused split reduce, split rules, graph replay)"
timeout -k 10 150 $PY -m pytest -q -p no:cacheprovider test/gpu/test_triton_kernels_gpu.py -m gpu \
  -k "fused_split_reduce or split_rules or cuda_graph_replay or decode_vs_torch_native" > "$OUT/issue19_fr_pytest.log" 2>&1
rc_tests=$?
tail -n 15 "$OUT/issue19_fr_pytest.log"

stage "2a. floors + decode, SGLANG_DECODE_FUSED_REDUCE=0 (default)"
SGLANG_DECODE_FUSED_REDUCE=0 timeout -k 10 140 $PY benchmark/bench_gpu_targets.py --only floors,decode --skip-serving \
  --out "$OUT/off" --time-budget-s 130 2>&1 | grep -v "^\s*$" | tail -n 15
rc_off=${PIPESTATUS[0]}

stage "2b. floors + decode, SGLANG_DECODE_FUSED_REDUCE=1"
SGLANG_DECODE_FUSED_REDUCE=1 timeout -k 10 140 $PY benchmark/bench_gpu_targets.py --only floors,decode --skip-serving \
  --out "$OUT/on" --time-budget-s 130 2>&1 | grep -v "^\s*$" | tail -n 15
rc_on=${PIPESTATUS[0]}

stage "3. summary: decode step, fused reduce off vs on (each vs the floor of its own run)"
$PY - "$OUT" <<'PYEOF'
import glob, json, sys
out = sys.argv[1]
def load(sub):
    f = sorted(glob.glob(f"{out}/{sub}/*_gpu_targets.json"))
    return {d["batch"]: d for d in (json.load(open(f[-1])) if f else {}).get("parts", {}).get("decode", {}).get("batches", [])}
off, on = load("off"), load("on")
print("| batch | off step (ms) | on step (ms) | on / off | off / floor | on / floor | target |")
print("|---:|---:|---:|---:|---:|---:|---|")
for bs in sorted(set(off) | set(on)):
    a, b = off.get(bs, {}), on.get(bs, {})
    sa, sb = a.get("median_step_s"), b.get("median_step_s")
    fa, fb = a.get("floor_s"), b.get("floor_s")
    g = lambda x: f"{x * 1e3:.3f}" if x else "n/a"
    r = lambda x, y: f"{x / y:.3f}" if x and y else "n/a"
    print(f"| {bs} | {g(sa)} | {g(sb)} | {r(sb, sa)} | {r(sa, fa)} | {r(sb, fb)} | <= 1.30 |")
PYEOF
echo "issue19 fused reduce: tests rc=$rc_tests off rc=$rc_off on rc=$rc_on; total $(( $(date +%s) - t_start )) s"
find "$OUT" -type f | sort
exit $(( rc_tests || rc_off || rc_on ))
