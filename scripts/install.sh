#!/usr/bin/env bash
# Install sglang-tw, its test dependencies and the optional extras CI tests (ray) into the current Python.
# On a CPU machine, `torch==2.13.0` resolves to the CPU build.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0" -e "$root/python[test,custom-logit-processor,ray]"
# PD disaggregation extra (nixl); without it the nixl tests skip and `--disaggregation-transfer-backend fake` works.
python3 -m pip install -q --disable-pip-version-check -e "$root/python[pd]" \
  || echo "install.sh: WARNING: the [pd] extra (nixl) did not install; nixl transfer tests will skip" >&2
if [ -f "$root/sgl-kernel/pyproject.toml" ]; then
  python3 -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e "$root/sgl-kernel"
fi
