#!/usr/bin/env bash
# Build a wheelhouse of every runtime dependency of sglang-tw that a stock CUDA + PyTorch image
# lacks, for CPython 3.12 on manylinux x86_64, on a machine WITH network access. Copy the folder
# (with the repo) to the offline GPU host and run scripts/install_offline.sh there.
#
#   scripts/build_wheelhouse.sh [-o DIR] [--present FILE] [--python-version 3.12] [--glibc 2.35]
#                               [--extras test,bench] [--extra-req REQ]...
#
#   -o DIR            wheelhouse folder (default: ./wheelhouse)
#   --present FILE    packages the target already has, skipped with their dependencies
#                     (default: scripts/wheelhouse_present.txt; best: `pip list --format=freeze`
#                     captured on the GPU host itself; '' for none)
#   --extras LIST     sglang optional-dependency groups to include (default: test)
#   --extra-req REQ   more requirements (default: xgrammar, the grammar backend)
#
# Dependencies are resolved by reading each wheel's METADATA recursively (scripts/resolve_wheelhouse.py);
# the folder gets requirements.txt (top level) and requirements.lock (every wheel, pinned).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$PWD/wheelhouse"
present="$root/scripts/wheelhouse_present.txt"
pyver="3.12"
glibc="2.35"
extras="test"
extra_reqs=()
while [ $# -gt 0 ]; do
  case "$1" in
    -o|--output) out="$2"; shift 2 ;;
    --present) present="$2"; shift 2 ;;
    --python-version) pyver="$2"; shift 2 ;;
    --glibc) glibc="$2"; shift 2 ;;
    --extras) extras="$2"; shift 2 ;;
    --extra-req) extra_reqs+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#extra_reqs[@]} -eq 0 ] && extra_reqs=("xgrammar")
args=(--dest "$out" --present "$present" --python-version "$pyver" --glibc "$glibc" --extras "$extras")
for r in "${extra_reqs[@]}"; do args+=(--extra-req "$r"); done
python3 "$root/scripts/resolve_wheelhouse.py" "${args[@]}"
echo "done: $(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
