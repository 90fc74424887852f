#!/usr/bin/env bash
# Install sglang-tw on a GPU host with no network, from a wheelhouse made by
# scripts/build_wheelhouse.sh (torch comes from the host's image and is left as is).
#
#   scripts/install_offline.sh WHEELHOUSE_DIR
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
wh="${1:?usage: scripts/install_offline.sh WHEELHOUSE_DIR}"
[ -f "$wh/requirements.txt" ] || { echo "error: $wh/requirements.txt is missing: pass the folder built by scripts/build_wheelhouse.sh" >&2; exit 2; }
pip="python3 -m pip --disable-pip-version-check"
# 1. the dependencies, only from the wheelhouse (what the image already has stays untouched)
$pip install --no-index --find-links "$wh" -r "$wh/requirements.txt"
# 2. the repo's packages, editable, with no dependency resolution and no build isolation (no network)
$pip install --no-index --no-deps --no-build-isolation -e "$root/python"
if [ -f "$root/sgl-kernel/pyproject.toml" ]; then
  $pip install --no-index --no-deps --no-build-isolation -e "$root/sgl-kernel"
fi
$pip check || echo "warning: pip check reports the problems above" >&2
python3 -c "import sglang, sglang.srt.entrypoints.http_server, sglang.bench_serving; print('sglang', sglang.__version__, 'installed')"
