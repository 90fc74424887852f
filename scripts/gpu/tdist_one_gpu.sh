#!/usr/bin/env bash
# Triton-distributed on ONE GPU, one device call of <= 9 minutes (H100 or H200; ranks are processes
# sharing the GPU, the symmetric heap mapped through CUDA IPC within the device, contexts time-sliced):
#   1. cpu_tests  AOT sm_90a compile + PTX checks (scoped acquire/release, bounded waits, no multimem) and the heap
#                 bookkeeping tests (CPU, as in CI);
#   2. gpu_cases  every primitive and kernel vs torch at world 2 and 4 (test_tdist_gpu.py::test_tdist_case), bounded:
#                 device waits give up after TDIST_WAIT_TIMEOUT_S and raise TdistWaitError naming kernel/rank/signal;
#                 each case's outcome is appended to $OUT/tdist_cases.jsonl as soon as all ranks reported it; a case
#                 that raises stops its group and the rest go on in a fresh group; a silent group is killed after
#                 TDIST_STALL_S;
#   3. engine     the sequence-parallel executor on the fused AG-GEMM / GEMM-RS (TP 2 and 4 sharing the GPU) equals
#                 the single process on stories260K;
#   4. bench      benchmark/tdist/bench_kernels.py smoke (2 ranks sharing the GPU; writes its table under $OUT);
#   5. server     (if >= 100 s are left) HTTP --tp 2 --tp-ranks-share-gpu --enable-tdist-overlap equals TP 1;
#   6. memcheck   (if >= 60 s are left) compute-sanitizer on the small 2-rank case; only its summary lines are kept.
# Every step has a time limit and runs even when an earlier one failed; $OUT/tdist_summary.txt lists each step's exit
# code (124 = hit its limit). Files in $OUT (<= 8): tdist_summary.txt, tdist_cpu_tests.log, tdist_gpu_cases.log,
# tdist_cases.jsonl, tdist_engine.log, tdist_bench.log, the bench's <date>_tdist_share_gpu.md, tdist_server.log.
# Usage (repo root; shared data at ../shared/data, or carried as .sd/ with scripts/gpu/device_preamble.sh, which
# this script sources when present): bash scripts/gpu/tdist_one_gpu.sh [seconds, default 530]
# Run one case alone: TDIST_CASES=case_gemm_rs python3 -m pytest -v test/gpu/test_tdist_gpu.py -k test_tdist_case
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # cds to the repo root ($root), NVLS off, PYTHONPATH, $PY, carried wheels/data
. "$root/scripts/gpu/lib_budget.sh"  # budget_start, left, step (run with a limit, keep the log, record the exit code)
export TRITON_DEFAULT_FP_FUSION=1
unset TDIST_CASES
budget_start "${1:-530}"
out="${OUT:-/tmp/tdist_gpu_logs}"; mkdir -p "$out"
rm -f "$out/tdist_cases.jsonl"
step_prefix=tdist_

{
  echo "== environment"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv 2>&1 | head -3
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" 2>&1
  env | grep -E "NVLS|MULTICAST" | sort
} | tee "$out/tdist_summary.txt"

step cpu_tests 100 python3 -m pytest -q -p no:cacheprovider test/unit/test_tdist_aot.py test/unit/test_tdist_heap.py

# per world size: TDIST_GPU_TIMEOUT for its groups (restarts included); device waits give up after 25 s
per_world=$(( ($(left) - 230) / 2 )); (( per_world > 150 )) && per_world=150; (( per_world < 60 )) && per_world=60
step gpu_cases $(( 2 * per_world + 25 )) env TDIST_RESULTS="$out/tdist_cases.jsonl" TDIST_GPU_TIMEOUT=$per_world \
  TDIST_STALL_S=70 TDIST_WAIT_TIMEOUT_S=25 python3 -m pytest -v -rA -p no:cacheprovider test/gpu/test_tdist_gpu.py \
  -k "test_tdist_case or test_case_selection"
echo "-- per-case results ($out/tdist_cases.jsonl)"
python3 - "$out/tdist_cases.jsonl" <<'EOF' 2>&1 | tee -a "$out/tdist_summary.txt"
import json, sys
try:
    lines = [json.loads(x) for x in open(sys.argv[1])]
except FileNotFoundError:
    lines = []
for d in lines:
    what = "ok" if d.get("ok") else "FAIL " + json.dumps(d.get("failures") or d.get("problems"))[:400]
    print(f"world {d['world']} {d['case']}: {what} ({d.get('seconds', '-')} s)")
print(f"{len(lines)} case results")
EOF

step engine $(( $(left) > 300 ? 150 : $(left) / 2 )) python3 -m pytest -v -rA -p no:cacheprovider \
  test/gpu/test_tdist_gpu.py -k "test_sequence_parallel_executor"

step bench $(( $(left) > 150 ? 75 : $(left) / 2 )) python3 benchmark/tdist/bench_kernels.py --world 2 --share-gpu \
  --tokens 1024 --a2a-tokens 256 --iters 3 --results-dir "$out" --timeout 60

if (( $(left) >= 100 )); then
  step server $(( $(left) - 15 )) python3 -m pytest -v -rA -p no:cacheprovider test/gpu/test_tdist_gpu.py \
    -k "test_server_tp2"
else
  summary+=("server: not run ($(left)s left < 100s)")
fi

if command -v compute-sanitizer >/dev/null && (( $(left) >= 60 )); then
  t0=$SECONDS
  timeout --kill-after=5 $(( $(left) - 10 )) compute-sanitizer --tool memcheck --target-processes all \
    python3 test/gpu/tdist_sanitizer_case.py > /tmp/tdist_memcheck.log 2>&1
  rc=$?
  summary+=("memcheck: exit $rc in $(( SECONDS - t0 ))s: $(grep -E 'ERROR SUMMARY|sanitizer case' /tmp/tdist_memcheck.log | sort | uniq -c | tr '\n' ' ')")
else
  summary+=("memcheck: not run (no compute-sanitizer or < 60s left)")
fi

echo; echo "== summary (logs in $out)"
printf '%s\n' "${summary[@]}" | tee -a "$out/tdist_summary.txt"
