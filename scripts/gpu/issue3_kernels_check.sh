#!/usr/bin/env bash
# Issue 3 (Triton kernels) check on one GPU: the GPU correctness tests, then the attention micro-benchmark.
# Usage (repo root): bash scripts/gpu/issue3_kernels_check.sh
# Writes benchmark/results/attention/<date>_triton_attention.md; when $OUT is set (device runner) also copies the
# results and the pytest log there.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"

log="$(mktemp)"
python3 -m pytest -q -p no:cacheprovider test/gpu/test_triton_kernels_gpu.py -m gpu 2>&1 | tee "$log"
test_rc=${PIPESTATUS[0]}

python3 benchmark/attention/bench_triton_attention.py --out benchmark/results/attention "$@"
bench_rc=$?

if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT/benchmark/results/attention"
  cp benchmark/results/attention/*_triton_attention.md "$OUT/benchmark/results/attention/" 2>/dev/null || true
  cp "$log" "$OUT/issue3_kernels_pytest.log"
fi
echo "pytest rc=$test_rc bench rc=$bench_rc"
exit $(( test_rc != 0 ? test_rc : bench_rc ))
