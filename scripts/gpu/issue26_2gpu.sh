#!/usr/bin/env bash
# Issue 26, round 2 on 2 GPUs (one rank per GPU), <= 200 s wall time with compilation. Correctness first:
#   1. decomp    test/gpu/test_tdist_decomp_gpu.py: decomposition AG-GEMM / GEMM-RS (cuBLAS per piece, copy-engine
#                pushes, GEMM-RS reduction fused into the own GEMM by addmm_) vs torch with planned and explicit
#                piece counts (2-4 pieces, uneven/empty segments), back-to-back calls, CUDA-graph capture + replays,
#                the Auto* NCCL fallback, the all-to-all and the Triton SM ops with cached metadata;
#   2. equal     --enable-tdist-overlap's layer stack with one rank per GPU (decomposition behind AutoAgGemm /
#                AutoGemmRs): greedy tokens of stories260K at TP2 equal the single process's, logits to 1e-3;
#   3. bench     benchmark/bench_tdist.py --world 2, Llama-3.3-70B TP4 shapes, M = 2048 / 8192, all-to-all 1024 x
#                7168; tdist SM, decomposition (planned pieces), NCCL + cuBLAS, torch symm-mem fused, cuBLAS alone;
#                variant 'pieces': the other piece counts (1/2/4) and all-to-all at 32/64 CTAs per peer in notes;
#                variant 'graph': the all-to-all (tdist and NCCL) also as CUDA-graph replays (no launch overhead);
#   4. layers    benchmark/bench_tokenweave.py: Llama-3.3-70B config cut to 4 layers, TP2, 4096 / 8192 tokens,
#                plain TP ('tp') vs --enable-tdist-overlap ('tdist'), median of CUDA-event timed prefill forwards;
#   memcheck     (after step 2) compute-sanitizer memcheck on the 2-rank decomposition case
#                (test/gpu/tdist_sanitizer_case.py decomp); racecheck on it last, if >= 30 s are left.
# Outputs in $OUT: issue26_summary.md (step exit codes, test results, tables), issue26_bench.md, issue26_layers.md
# and one log per step. Usage (repo root): bash scripts/gpu/issue26_2gpu.sh [seconds, default 200]
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
if [ -f scripts/gpu/device_preamble.sh ]; then source scripts/gpu/device_preamble.sh; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$root/python:$root/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET TDIST_CASES
budget="${1:-200}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/issue26_out}"; mkdir -p "$out"
summary=()
step() {  # step NAME SECONDS CMD...: run with a limit, keep the log, record the exit code, never stop the script
  local name="$1" secs="$2"; shift 2
  (( secs > $(left) - 2 )) && secs=$(( $(left) - 2 ))
  (( secs < 10 )) && { summary+=("- $name: not run (no time left)"); return; }
  echo; echo "== $name (limit ${secs}s, $(left)s left)"
  local t0=$SECONDS
  timeout --kill-after=5 "$secs" "$@" > "$out/issue26_$name.log" 2>&1
  local rc=$?
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|^\| |Error|ERROR SUMMARY|sanitizer case|\[partial\]" "$out/issue26_$name.log" | tail -30
  (( rc == 124 || rc == 137 )) && echo "!! $name hit its ${secs}s limit"
  summary+=("- $name: exit $rc in $(( SECONDS - t0 ))s")
}
cfg70=../shared/data/configs/meta-llama--Llama-3.3-70B-Instruct

{
  echo "# issue 26 round 2 ($(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -2
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" 2>&1
  env | grep -E "NVLS|MULTICAST" | sort
} | tee "$out/issue26_summary.md"

step decomp 35 env TDIST_GPU_TIMEOUT=30 python3 -m pytest -v -rA -p no:cacheprovider test/gpu/test_tdist_decomp_gpu.py

step equal 45 python3 -m pytest -v -rA -p no:cacheprovider test/gpu/test_tdist_gpu.py \
  -k "one_rank_per_gpu and decomp"

if command -v compute-sanitizer >/dev/null; then
  step memcheck 30 compute-sanitizer --tool memcheck --target-processes all python3 test/gpu/tdist_sanitizer_case.py decomp
else
  summary+=("- memcheck: not run (no compute-sanitizer on PATH)")
fi

step bench 45 python3 benchmark/bench_tdist.py --world 2 --tp-shapes 4 --tokens 2048 8192 \
  --a2a-tokens 1024 --a2a-hidden 7168 --iters 20 --variants sm decomp pieces graph --results-dir "$out" --timeout 40
for f in "$out"/*_tdist.md; do [ -f "$f" ] && mv "$f" "$out/issue26_bench.md"; done

step layers 50 python3 benchmark/bench_tokenweave.py --model-path "$cfg70" --tp 2 --layers 4 --tokens 4096 8192 \
  --variants tp tdist --iters 5 --warmup 3 --results-dir "$out/layers" --timeout 45
for f in "$out"/layers/*_tokenweave_layer.md; do [ -f "$f" ] && mv "$f" "$out/issue26_layers.md"; done
rmdir "$out/layers" 2>/dev/null

if command -v compute-sanitizer >/dev/null && (( $(left) >= 30 )); then
  step racecheck $(( $(left) - 3 )) compute-sanitizer --tool racecheck --target-processes all \
    python3 test/gpu/tdist_sanitizer_case.py decomp
else
  summary+=("- racecheck: not run (no compute-sanitizer or $(left)s left < 30s)")
fi

{
  echo; echo "## steps"; printf '%s\n' "${summary[@]}"
  echo; echo "## test results"
  grep -hE "(PASSED|FAILED|SKIPPED|ERROR) *(\[|$)|^(FAILED|ERROR) " "$out"/issue26_decomp.log "$out"/issue26_equal.log \
    2>/dev/null | sed 's/^/    /' | head -30
  for t in memcheck racecheck; do
    [ -f "$out/issue26_$t.log" ] && echo "    $t: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitizer case' \
      "$out/issue26_$t.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
  done
  echo; echo "## bench (issue26_bench.md)"
  grep -E "^\| |^calibration|^- (date|hardware|command)" "$out/issue26_bench.md" 2>/dev/null || echo "no table (see issue26_bench.log)"
  echo; echo "## layer stack (issue26_layers.md)"
  grep -E "^\| |^- (date|hardware|command|note)" "$out/issue26_layers.md" 2>/dev/null \
    || { echo "no table (see issue26_layers.log); rows measured:"; grep "\[partial\]" "$out/issue26_layers.log" 2>/dev/null; }
} | tee -a "$out/issue26_summary.md"
