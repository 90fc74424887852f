#!/usr/bin/env bash
# Install everything, then run the whole test suite (GPU tests skip without a GPU).
#
# Parallel: on a machine without a GPU the test files run on SGLANG_TEST_WORKERS pytest-xdist workers (default 3:
# most of a file's time is servers and process groups starting and waiting on each other, so 3 workers keep the 2
# cores of the CI machine busy; test/parallel_plan.py says how files are grouped and ordered). SGLANG_TEST_WORKERS=0
# runs serially in collection order, as does a GPU host by default (the GPU tests size their memory from the whole
# device). Arguments are passed to pytest (e.g. `bash scripts/run_tests.sh -q -p no:cacheprovider`).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/install.sh"
cd "$root"
# Byte-compile this checkout once: with PYTHONDONTWRITEBYTECODE set (as on the CI machines) no process writes .pyc,
# so every server process, rank and subprocess the tests start would compile the sglang sources again (about 0.25
# CPU-s per process, over the thousand-odd processes a run starts). Reading .pyc is not affected by that variable.
python3 -m compileall -q -j 0 python sgl-kernel/python test benchmark > /dev/null || true
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
workers="${SGLANG_TEST_WORKERS:-}"
if [ -z "$workers" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then workers=0; else workers=3; fi
fi
parallel=()
if [ "$workers" != 0 ]; then
  python3 -c "import xdist" 2>/dev/null || { echo "run_tests.sh: pytest-xdist is missing (the [test] extra)" >&2; exit 1; }
  parallel=(-n "$workers" --dist loadfile)
fi
exec python3 -m pytest test ${parallel[@]+"${parallel[@]}"} "$@"
