#!/usr/bin/env bash
# The common start of every scripts/gpu/*.sh and of a device-machine run. Source it, from anywhere:
#   . "$(dirname "$0")/device_preamble.sh"          (in a script)      . scripts/gpu/device_preamble.sh   (a run)
# It sets root (the repo root) and cds there, exports the NVLS-off environment (NCCL_NVLS_ENABLE=0
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1) and PYTHONUNBUFFERED=1, unsets TRITON_INTERPRET, sets
# PY="${PYTHON:-python3}", puts python/ and sgl-kernel/python first on PYTHONPATH and creates $OUT when set. Once
# per environment (SGLANG_DEVICE_PREAMBLE marks it done) it installs the carried wheels (.whl/) into /tmp/site and
# links the carried test data (.sd/ -> ../shared/data).
# Prepare here first: scripts/build_wheelhouse.sh -o .whl; scripts/gpu/stage_shared_data.sh
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root" || return 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
if [ -z "${SGLANG_DEVICE_PREAMBLE:-}" ]; then
  export SGLANG_DEVICE_PREAMBLE=1
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || echo "WHEEL INSTALL FAILED"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if [ -d .sd ] && [ ! -e ../shared/data ]; then mkdir -p ../shared && ln -s "$root/.sd" ../shared/data; fi
  # large text files travel gzipped (stage_shared_data.sh): tokenizer.json 17 MB -> 2.5 MB
  if [ -d "$root/.sd" ]; then
    find "$root/.sd" -name '*.gz' | while read -r f; do [ -e "${f%.gz}" ] || gunzip -k "$f"; done
  fi
fi
export PYTHONPATH="$root/python:$root/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; fi
