#!/usr/bin/env bash
# --attention-backend flashinfer on one GPU in one device call: install the carried FlashInfer wheels, time the JIT
# of the modules the backend uses, run its GPU tests, then benchmark it against the Triton backend (prefill 1K / 8K,
# decode batch 1 / 32 / 128, same run, alternated order).
# Prepare (networked machine): scripts/gpu/build_flashinfer_slim_wheels.sh -o .whl   (flashinfer-python slim +
# apache-tvm-ffi, ~31 MiB); carry .whl (and .sd for the 8B config test) with the call. If .whl with the rest of the
# wheelhouse exceeds a call, carry only the FlashInfer wheels in a first call (device_preamble.sh installs them
# into /tmp/site, kept while the machine is warm) and the rest in a second one with PYTHONPATH=/tmp/site exported.
# Usage: bash scripts/gpu/flashinfer_attention.sh [budget_s=540]     DRY_RUN=1 prints the commands.
# Writes $OUT/flashinfer_attention.log (summary), $OUT/fi_*.log, and the benchmark's json/md under $OUT.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"
OUT="${OUT:-$(mktemp -d /tmp/flashinfer-attention.XXXXXX)}"
mkdir -p "$OUT"
out="$OUT"
step_prefix="fi_"
step_dry="${DRY_RUN:-}"
start_run "$OUT/flashinfer_attention.log" "${1:-540}"
nvcc --version 2>/dev/null | tail -1 || echo "nvcc not on PATH (FlashInfer's JIT needs it)"
if ! "$PY" -c "import flashinfer, tvm_ffi; print('flashinfer', flashinfer.__version__)"; then
  echo "flashinfer does not import: build the wheels with scripts/gpu/build_flashinfer_slim_wheels.sh -o .whl"
  [ -z "$step_dry" ] && exit 3
fi
# the JIT of the two modules the backend uses (Llama-3.1-8B heads, bf16), timed; cached in ~/.cache/flashinfer
step jit 240 "$PY" - <<'PY'
import time, torch
from flashinfer.jit.attention import modules as m
for name, spec in (("batch prefill (paged, FA2; also tensor-core decode)",
                    m.gen_batch_prefill_module("fa2", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32,
                                               128, 128, 0, False, False, False)),
                   ("batch decode (CUDA cores)", m.gen_batch_decode_module(torch.bfloat16, torch.bfloat16,
                                                                            torch.bfloat16, torch.int32, 128, 128, 0,
                                                                            False, False))):
    t0 = time.time()
    spec.build_and_load()
    print(f"JIT {name}: {time.time() - t0:.1f} s ({spec.name})")
PY
step tests 200 "$PY" -m pytest -q -p no:cacheprovider -rfEs --timeout 180 --durations=10 -m "gpu or gpu_extended" \
  test/gpu/test_flashinfer_gpu.py
step bench_ps1 "$(cap 150)" "$PY" benchmark/attention/bench_flashinfer_vs_triton.py --page-size 1 --out "$OUT"
step bench_ps16 "$(cap 120)" "$PY" benchmark/attention/bench_flashinfer_vs_triton.py --page-size 16 --out "$OUT"
stage "summary"
printf '%s\n' "${summary[@]}"
grep -h "^JIT" "$OUT/fi_jit.log" 2>/dev/null
cat "$OUT"/*attention_flashinfer_vs_triton*.md 2>/dev/null
