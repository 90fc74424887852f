#!/usr/bin/env bash
# Install sglang-tw, its test dependencies and the optional extras CI tests (ray) into the current Python.
# The first command is the README quickstart's install command (`sglang` and `sgl_kernel` from this checkout,
# editable) with more extras; test/unit/test_install_paths.py keeps the two in step.
# On a CPU machine, `torch==2.13.0` resolves to the CPU build.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0" -e "./python[test,custom-logit-processor,ray]" -e ./sgl-kernel
# PD disaggregation extra (nixl); without it the nixl tests skip and `--disaggregation-transfer-backend fake` works.
python3 -m pip install -q --disable-pip-version-check -e "./python[pd]" -e ./sgl-kernel \
  || echo "install.sh: WARNING: the [pd] extra (nixl) did not install; nixl transfer tests will skip" >&2
