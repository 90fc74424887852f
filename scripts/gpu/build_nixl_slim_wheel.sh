#!/usr/bin/env bash
# Build a slimmed NIXL wheel (UCX plugin only) small enough to travel with the other wheels in one 64 MiB
# device call. Run on a machine WITH network access (or pass a downloaded wheel):
#
#   scripts/gpu/build_nixl_slim_wheel.sh [-o DIR] [--wheel PATH] [--version 1.5.1]
#
#   -o DIR       where the slim wheel goes (default: ./.whl, the folder device_preamble.sh installs from)
#   --wheel P    an already downloaded nixl_cu13-*.whl (default: pip download nixl-cu13==VERSION for
#                CPython 3.12 manylinux_2_28 x86_64; VERSION defaults to the `pd` extra's pin in python/pyproject.toml)
#
# The stock nixl-cu13 wheel (~56 MiB) carries the NIXL-EP torch extensions for three torch versions (~27 MiB),
# every backend plugin (GPUNETIO, GDS, object stores, LIBFABRIC, ...) and their AWS/Azure/gRPC/etcd client
# libraries. sglang-tw only uses the UCX backend (KV transfer and M2N: NIXL READ/WRITE over UCX cuda_ipc /
# cuda_copy / rc). The script keeps nixl_cu13/ (Python API and bindings), libnixl*, the UCX plugin, all UCX
# transport modules, and exactly the bundled libraries those ELF files need (DT_NEEDED closure via readelf);
# everything else is dropped and RECORD is rewritten (same name and version, so `nixl-cu13>=X` resolves to it).
# libnixl itself links gRPC/etcd (kept). The result is ~12.8 MiB.
# Check on the device: python -c "import nixl_cu13._api as n; print(n.nixl_agent)".
#
# Fallback without slimming (two calls): call 1 carries only the stock wheel in .whl/ and pip-installs it
# (`pip install --no-deps .whl/nixl_cu13-*.whl`); it stays installed while the machine is warm, so call 2
# (within the idle window) carries the rest of the wheelhouse.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="$PWD/.whl"
wheel=""
version="$(sed -n 's/^pd = \["nixl-cu13>=\([0-9.]*\)"\]/\1/p' "$root/python/pyproject.toml")"
while [ $# -gt 0 ]; do
  case "$1" in
    -o|--output) out="$2"; shift 2 ;;
    --wheel) wheel="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
command -v readelf >/dev/null || { echo "error: readelf (binutils) is needed" >&2; exit 2; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
if [ -z "$wheel" ]; then
  [ -n "$version" ] || { echo "error: no nixl-cu13 pin found in python/pyproject.toml; pass --version" >&2; exit 2; }
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$tmp/dl" "nixl-cu13==$version"
  wheel="$(ls "$tmp"/dl/nixl_cu13-*.whl)"
fi
mkdir -p "$out"
python3 - "$wheel" "$out" "$tmp/x" <<'PY'
import base64, hashlib, os, re, shutil, subprocess, sys, zipfile

src, out, work = sys.argv[1:4]
zipfile.ZipFile(src).extractall(work)
pkg = next(d for d in os.listdir(work) if d.endswith(".dist-info"))
name = pkg[:-len(".dist-info")].split("-")[0]             # nixl_cu13
drop_dirs = [f"{name.replace('nixl', 'nixl_ep')}", f"{name}.scripts"]
for d in drop_dirs + [p for p in os.listdir(work) if p.endswith(".data")]:
    shutil.rmtree(os.path.join(work, d), ignore_errors=True)
def is_elf(p):
    with open(p, "rb") as f:
        return f.read(4) == b"\x7fELF"
files = [os.path.join(r, f) for r, _, fs in os.walk(work) for f in fs]
DROP = ("perftest", "libobj_utils", "libnixl_test_utils", "libtelemetry_exporter", "libtrace_backend")
for p in files:  # plugins other than UCX, object-store helpers, telemetry exporters, UCX perftest
    b = os.path.basename(p)
    if (b.startswith("libplugin_") and b != "libplugin_UCX.so") or any(d in b for d in DROP):
        os.remove(p)
files = [os.path.join(r, f) for r, _, fs in os.walk(work) for f in fs]
libs_dir = os.path.join(work, f"{name}.libs")
bundled = {os.path.basename(p): p for p in files if p.startswith(libs_dir + os.sep)
           and os.path.dirname(p) == libs_dir and is_elf(p)}
roots = [p for p in files if is_elf(p) and p not in bundled.values()]
def needed(p):
    r = subprocess.run(["readelf", "-d", p], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\).*\[(.+?)\]", r)
keep, todo = set(), list(roots)
while todo:
    for n in needed(todo.pop()):
        if n in bundled and n not in keep:
            keep.add(n)
            todo.append(bundled[n])
for n, p in bundled.items():
    if n not in keep:
        os.remove(p)
record = os.path.join(work, pkg, "RECORD")
rows = []
for r, _, fs in os.walk(work):
    for f in fs:
        p = os.path.join(r, f)
        rel = os.path.relpath(p, work)
        if p == record:
            continue
        h = base64.urlsafe_b64encode(hashlib.sha256(open(p, "rb").read()).digest()).rstrip(b"=").decode()
        rows.append(f"{rel},sha256={h},{os.path.getsize(p)}")
rows.append(f"{pkg}/RECORD,,")
open(record, "w").write("\n".join(sorted(rows)) + "\n")
dst = os.path.join(out, os.path.basename(src))
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for r, _, fs in os.walk(work):
        for f in sorted(fs):
            p = os.path.join(r, f)
            z.write(p, os.path.relpath(p, work))
print(f"{dst}: {os.path.getsize(dst) / 2**20:.1f} MiB (from {os.path.getsize(src) / 2**20:.1f} MiB); "
      f"kept {len(keep)} of {len(bundled)} bundled libraries")
PY
