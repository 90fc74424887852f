#!/usr/bin/env bash
# The GPU test suite in one device call, with per-test durations (test/README.md describes the tiers).
# Usage (repo root, carry .whl and .sd):
#   bash scripts/gpu/gpu_suite.sh smoke [budget_s=450]      pytest -m gpu: every GPU code path once (< 8 min, one GPU)
#   bash scripts/gpu/gpu_suite.sh order [budget_s=300]      the 8B ModelRunner test in this pytest process, then the
#                                                           dummy-8B server test (the order that used to fail)
#   bash scripts/gpu/gpu_suite.sh extended [budget_s=540]   pytest -m gpu_extended (more than one call's worth on one
#                                                           GPU: pass PYTEST_ARGS="test/gpu/<file>.py ..." to split it)
# DRY_RUN=1 prints the commands. Writes $OUT/gpu_suite_<tier>.log (the pytest output, slowest 25 tests last) and
# $OUT/gpu_suite.log (environment, summary).
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$root/scripts/gpu/lib_budget.sh"
tier="${1:-smoke}"
case "$tier" in
  smoke) sel=(-m gpu); want=450 ;;
  order) sel=(-m "gpu or gpu_extended" test/gpu/test_memory_budget_gpu.py test/gpu/test_server_dummy_llama8b.py)
         want=300 ;;
  extended) sel=(-m gpu_extended); want=540 ;;
  *) echo "unknown tier '$tier' (smoke | order | extended)"; exit 2 ;;
esac
OUT="${OUT:-$(mktemp -d /tmp/gpu-suite.XXXXXX)}"
mkdir -p "$OUT"
step_dry="${DRY_RUN:-}"
start_run "$OUT/gpu_suite.log" "${2:-$want}"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>/dev/null || echo "nvidia-smi unavailable"
# a hung test fails by itself (pytest-timeout) instead of eating the call; the step's limit leaves 10 s to report
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words on purpose
step "gpu_suite_$tier" $(( $(left) - 10 )) "$PY" -m pytest "${sel[@]}" ${PYTEST_ARGS:-} -q -p no:cacheprovider \
  -rfEs --timeout 240 --durations=25
rc=$?
stage "summary"
printf '%s\n' "${summary[@]}"
grep -E "^[0-9.]+s (call|setup|teardown) " "$OUT/gpu_suite_$tier.log" 2>/dev/null | head -n 25
exit "$rc"
