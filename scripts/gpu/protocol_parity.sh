#!/usr/bin/env bash
# SGLang protocol parity on one GPU: the sampler pieces (logit_bias, token_ids_logprob, grammar-masked
# top logprobs) on CUDA, then the client-parity integration tests against a stories260K server on cuda.
# Usage (repo root): bash scripts/gpu/protocol_parity.sh     (logs under $OUT when set)
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
logdir="${OUT:-$(mktemp -d /tmp/protocol-parity.XXXXXX)}"
mkdir -p "$logdir"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi failed"
"$PY" -c "import dill" 2>/dev/null || "$PY" -m pip install -q dill || echo "dill missing: the custom processor test skips"
rc=0
timeout 200 "$PY" -m pytest -q -rs test/unit/test_protocol_parity.py 2>&1 | tee "$logdir/unit.log" || rc=1
SGLANG_TEST_DEVICE=cuda timeout 360 "$PY" -m pytest -q -rs test/integration/test_sglang_client_parity.py 2>&1 \
  | tee "$logdir/integration.log" || rc=1
cp /tmp/sglang-test-server-*.log "$logdir/" 2>/dev/null || true
echo "protocol_parity: rc=$rc (logs in $logdir)"
exit $rc
