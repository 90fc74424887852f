#!/usr/bin/env bash
# Compile every tw-comm CUDA source for sm_90a (objects only), print register/spill report, and dump the NVLS
# kernel's PTX. Usage: tw-comm/tests/check_compile.sh [outdir]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$(mktemp -d)}"
mkdir -p "$out"
pids=()
for f in "$here"/csrc/allreduce_rmsnorm/*.cu; do
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -Xptxas -v -I"$here/include" \
       -c "$f" -o "$out/$(basename "$f" .cu).o" 2>"$out/$(basename "$f" .cu).ptxas.txt" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || { cat "$out"/*.ptxas.txt; echo "nvcc failed"; exit 1; }; done
nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I"$here/include" -ptx "$here/csrc/allreduce_rmsnorm/nvls.cu" \
     -o "$out/nvls.ptx"
grep -c multimem "$out/nvls.ptx" | sed 's/^/multimem instructions in nvls.ptx: /'
if grep -h "spill" "$out"/*.ptxas.txt | grep -v " 0 bytes spill stores, 0 bytes spill loads" ; then
  echo "WARNING: register spills above"
fi
echo "objects in $out"
