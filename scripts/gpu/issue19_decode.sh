#!/usr/bin/env bash
# Issue 19 on one H200 (one device call, <= 9 minutes): decode step within 1.3x of the memory floor.
#   1. Triton kernel GPU tests (test/gpu/test_triton_kernels_gpu.py, incl. the new decode split rules, fused
#      RoPE + KV store, packed sampling columns, graph replay at a one-split size) + greedy_e2e (GPU == CPU).
#   2. Kernel micro-benchmark, old vs new in the same process: decode attention per layer at batch 1/32/128 x 1K
#      (legacy kernel + rule vs new + a split / tile sweep), RoPE + KV store unfused vs fused, cuBLAS vs the
#      skinny Triton GEMM at 1 / 16 rows (measured only, not wired), sampling copies.
#   3. bench_gpu_targets --only decode with the OLD paths (SGLANG_TRITON_DECODE_LEGACY=1 SGLANG_FUSED_ROPE_KV=0),
#      then --only floors,attention,decode with the new defaults (same machine, same run).
#      3c, only if time is left: decode at batch 1 / 16 with SGLANG_SKINNY_GEMM=1 (experimental, log only).
#   4. benchmark/decode/profile_step.py --batches 1 32 128 (new defaults): kernel table + host ops per step.
#   5. A summary: decode step old vs new, ratio to the floor measured in step 3 (target <= 1.30).
# Usage (repo root): bash scripts/gpu/issue19_decode.sh      Every stage has its own timeout, so one hang cannot
# eat the others. Writes at most 8 files under $OUT (default /tmp/out):
#   issue19_run.log, issue19_pytest.log, <date>_decode_attention_rope_kernels.md, legacy/<date>_gpu_targets.{md,json},
#   new/<date>_gpu_targets.{md,json}, issue19_profile.txt
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # cds to the repo root ($root), NVLS off, PYTHONPATH, $PY, carried wheels/data
. "$root/scripts/gpu/lib_budget.sh"  # budget_start, left, elapsed, stage, log_to
export TRITON_DEFAULT_FP_FUSION=1
unset SGLANG_TRITON_DECODE_LEGACY SGLANG_FUSED_ROPE_KV
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT/legacy" "$OUT/new"
log_to "$OUT/issue19_run.log"
budget_start 520

stage "environment"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv || true
$PY -c "import torch, triton, sglang, sgl_kernel; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.version.cuda, '|', sglang.__file__, sgl_kernel.__file__)"

stage "1. Triton kernel GPU tests + greedy_e2e"
timeout -k 10 140 $PY -m pytest -q -p no:cacheprovider test/gpu/test_triton_kernels_gpu.py -m gpu \
  > "$OUT/issue19_pytest.log" 2>&1
rc_kernels=$?
timeout -k 10 90 $PY -m pytest -q -p no:cacheprovider test/gpu/test_gpu_correctness.py -k greedy_e2e \
  >> "$OUT/issue19_pytest.log" 2>&1
rc_e2e=$?
tail -n 25 "$OUT/issue19_pytest.log"
echo "kernel tests rc=$rc_kernels greedy_e2e rc=$rc_e2e"

stage "2. kernel micro-benchmark (old vs new, one process)"
timeout -k 10 90 $PY benchmark/decode/attention_rope_kernels.py --out "$OUT"
rc_micro=$?

stage "3a. decode steps, OLD paths (legacy decode kernel + split rule, unfused RoPE/KV store)"
SGLANG_TRITON_DECODE_LEGACY=1 SGLANG_FUSED_ROPE_KV=0 timeout -k 10 90 $PY benchmark/serving/bench_gpu_targets.py \
  --only decode --skip-serving --out "$OUT/legacy" --time-budget-s 85 2>&1 | grep -v "^\s*$" | tail -n 15
rc_old=${PIPESTATUS[0]}

stage "3b. floors + attention + decode steps, NEW defaults"
timeout -k 10 100 $PY benchmark/serving/bench_gpu_targets.py --only floors,attention,decode --skip-serving \
  --out "$OUT/new" --time-budget-s 95 2>&1 | grep -v "^\s*$" | tail -n 20
rc_new=${PIPESTATUS[0]}

stage "3c. (if time is left) decode steps at batch 1 and 16 with the experimental skinny GEMM (SGLANG_SKINNY_GEMM=1)"
if (( $(elapsed) < 330 )); then
  SGLANG_SKINNY_GEMM=1 timeout -k 10 80 $PY benchmark/serving/bench_gpu_targets.py --only decode --decode-batches 1,16 \
    --skip-serving --out /tmp/issue19_skinny --time-budget-s 75 2>&1 | grep -E "decode bs=|decode step" | tail -n 6
else
  echo "skipped: $(elapsed) s elapsed"
fi

stage "4. profile_decode (new defaults)"
timeout -k 10 $(( $(left) > 30 ? $(left) : 30 )) \
  $PY benchmark/decode/profile_step.py --batches 1 32 128 --top 16 > "$OUT/issue19_profile.txt" 2>&1
rc_prof=$?
grep -E "^## batch|_decode_|rope|index_elementwise|Memcpy|cudaMemcpyAsync" "$OUT/issue19_profile.txt" | head -n 40

stage "5. summary: decode step old vs new (floor from the new run's copy bandwidth)"
$PY - "$OUT" <<'EOF'
import glob, json, sys
out = sys.argv[1]
def load(sub):
    f = sorted(glob.glob(f"{out}/{sub}/*_gpu_targets.json"))
    return json.load(open(f[-1])) if f else {}
old, new = load("legacy"), load("new")
ob = {d["batch"]: d for d in old.get("parts", {}).get("decode", {}).get("batches", [])}
nb = {d["batch"]: d for d in new.get("parts", {}).get("decode", {}).get("batches", [])}
print("| batch | old step (ms) | new step (ms) | floor (ms) | old / floor | new / floor | target |")
print("|---:|---:|---:|---:|---:|---:|---|")
for bs in sorted(set(ob) | set(nb)):
    o, n = ob.get(bs, {}), nb.get(bs, {})
    fl = n.get("floor_s")
    f = lambda d: f"{d['median_step_s'] * 1e3:.3f}" if d.get("median_step_s") else "n/a"
    r = lambda d: f"{d['median_step_s'] / fl:.2f}" if d.get("median_step_s") and fl else "n/a"
    print(f"| {bs} | {f(o)} | {f(n)} | {fl * 1e3:.3f} | {r(o)} | {r(n)} | <= 1.30 |" if fl else
          f"| {bs} | {f(o)} | {f(n)} | n/a | n/a | n/a | <= 1.30 |")
EOF
echo
echo "issue19: kernels rc=$rc_kernels e2e rc=$rc_e2e micro rc=$rc_micro old rc=$rc_old new rc=$rc_new" \
  "profile rc=$rc_prof; total $(elapsed) s; files under $OUT:"
find "$OUT" -type f | sort
exit $(( rc_kernels || rc_e2e || rc_micro || rc_old || rc_new || rc_prof ))
