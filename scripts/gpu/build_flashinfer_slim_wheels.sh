#!/usr/bin/env bash
# Build the wheels --attention-backend flashinfer needs on the offline device (CPython 3.12, manylinux_2_28 x86_64,
# torch 2.11 cu130, nvcc 13, ninja): a slimmed flashinfer-python and apache-tvm-ffi. Run on a machine WITH network
# access (docs/attention_flashinfer.md has the sizes and the reasoning):
#
#   scripts/gpu/build_flashinfer_slim_wheels.sh [-o DIR] [--version 0.7.2] [--wheel PATH]
#
#   -o DIR       output folder (default: ./.whl, the folder device_preamble.sh installs from)
#   --version V  flashinfer-python version (default 0.7.2, the version SGLang 0.5.23 pins)
#   --wheel P    an already downloaded flashinfer_python-*.whl
#
# The stock flashinfer-python wheel (0.7.x: ~97 MiB, 680 MiB unpacked) carries the CUDA sources of every kernel
# family for FlashInfer's JIT. The paged prefill/decode wrappers compile only the batch prefill / decode modules, so
# the slim wheel keeps every Python file (``import flashinfer`` imports most of them), the headers the JIT build
# includes (data/include, data/cccl, data/spdlog, CUTLASS's include dirs) and, of data/csrc, only the batch /
# single prefill and decode sources and templates, page.cu and tvm_ffi_utils.h. Same name and version, RECORD
# rewritten. Its other run-time dependencies (cuda-tile, nccl4py, nvidia-cudnn-frontend, nvidia-cutlass-dsl, ...)
# are not needed by these wrappers (``import flashinfer`` works without them) and are not carried; the device image
# has numpy, einops, click, tabulate, requests, tqdm, packaging, ninja and nvidia-ml-py.
set -euo pipefail
out="$PWD/.whl"
version="0.7.2"
wheel=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o|--output) out="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --wheel) wheel="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
dl=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64
    -d "$tmp/dl")
if [ -z "$wheel" ]; then
  "${dl[@]}" "flashinfer-python==$version"
  wheel="$(ls "$tmp"/dl/flashinfer_python-*.whl)"
fi
tvm_pin="$(unzip -p "$wheel" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: apache-tvm-ffi\([^;]*\)$/\1/p' | head -1)"
"${dl[@]}" --implementation cp "apache-tvm-ffi${tvm_pin:->=0.1.11}"
mkdir -p "$out"
cp "$tmp"/dl/apache_tvm_ffi-*.whl "$out/"
python3 - "$wheel" "$out" <<'PY'
import base64, hashlib, io, os, re, sys, zipfile

src, out = sys.argv[1:3]
zin = zipfile.ZipFile(src)
info = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
dist = info.rsplit("/", 1)[0]
HEADERS = ("flashinfer/data/include/", "flashinfer/data/cccl/", "flashinfer/data/spdlog/",
           "flashinfer/data/cutlass/include/", "flashinfer/data/cutlass/tools/util/include/")
CSRC = re.compile(r"^flashinfer/data/csrc/(batch_decode[^/]*|batch_prefill[^/]*|single_decode[^/]*|single_prefill[^/]*"
                  r"|page\.cu|tvm_ffi_utils\.h)$")


def keep(name: str) -> bool:
    if name.startswith(dist + "/"):
        return not name.endswith("/RECORD")
    if name.startswith("flashinfer/data/"):
        return name.startswith(HEADERS) or bool(CSRC.match(name))
    return name.startswith("flashinfer/") and name.endswith(".py")


rows, buf = [], io.BytesIO()
with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for item in zin.infolist():
        if item.is_dir() or not keep(item.filename):
            continue
        data = zin.read(item)
        zout.writestr(item, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{item.filename},sha256={digest},{len(data)}")
    rows.append(f"{dist}/RECORD,,")
    zout.writestr(f"{dist}/RECORD", "\n".join(rows) + "\n")
dst = os.path.join(out, os.path.basename(src))
open(dst, "wb").write(buf.getvalue())
print(f"{dst}: {os.path.getsize(dst) / 2**20:.1f} MiB (from {os.path.getsize(src) / 2**20:.1f} MiB), "
      f"{len(rows) - 1} files")
PY
ls -l "$out"/flashinfer_python-*.whl "$out"/apache_tvm_ffi-*.whl
du -ch "$out"/flashinfer_python-*.whl "$out"/apache_tvm_ffi-*.whl | tail -1
