#!/usr/bin/env bash
# Source this at the start of a device-machine run (repo root): installs the carried wheels (.whl/) into
# /tmp/site, links carried test data (.sd/ -> ../shared/data) and sets the NVLS-off environment.
# Prepare here first: scripts/build_wheelhouse.sh -o .whl; scripts/gpu/stage_shared_data.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
_root="$(pwd)"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "WHEEL INSTALL FAILED"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$_root/python:$_root/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .sd ] && [ ! -e ../shared/data ]; then mkdir -p ../shared && ln -s "$_root/.sd" ../shared/data; fi
export OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
