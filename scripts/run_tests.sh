#!/usr/bin/env bash
# Install everything, then run the whole test suite (GPU tests skip without a GPU).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/install.sh"
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec python3 -m pytest test "$@"
