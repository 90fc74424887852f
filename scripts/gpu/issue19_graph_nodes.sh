#!/usr/bin/env bash
# Issue 19 A/B of the two graph-node switches (both default off) on one H100/H200, one device call (<= 9 minutes):
#   SGLANG_DECODE_FUSED_REDUCE=1  fused split reduce in the decode attention kernel (no reduce launch per layer)
#   SGLANG_GRAPH_GREEDY=1         argmax captured in the decode CUDA graph (sampler skipped for all-greedy batches)
#   1. GPU tests: fused reduce (vs torch_native and the two-launch path, 200 CUDA-graph replays bit-identical,
#      counters back at zero), the decode split-rule / graph-replay tests, graph-greedy ids == sampler ids.
#   2. benchmark/bench_decode_ab.py (one process): the copy-bandwidth floor, then per setting (off, fr = fused reduce,
#      gg = graph greedy, both; order alternated between repetitions) and batch 1/32/128 x 1K: the decode step vs the
#      floor, host time inside ModelRunner.forward around the replay, replay-only GPU time, graph node count.
# Usage (repo root): bash scripts/gpu/issue19_graph_nodes.sh      Writes under $OUT (default /tmp/out):
#   issue19_fr_run.log, issue19_fr_pytest.log, issue19_decode_ab.log, issue27_decode_ab.{md,json}
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
if [[ -f scripts/gpu/device_preamble.sh ]]; then source scripts/gpu/device_preamble.sh; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$root/python:$root/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET SGLANG_TRITON_DECODE_LEGACY SGLANG_DECODE_FUSED_REDUCE SGLANG_GRAPH_GREEDY
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
exec > >(tee -a "$OUT/issue19_fr_run.log") 2>&1
t_start=$(date +%s)
stage() { echo; echo "== $1 ($(( $(date +%s) - t_start )) s elapsed)"; }

stage "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true

stage "1. GPU tests (fused split reduce, split rules, graph replay, graph greedy)"
timeout -k 10 120 $PY -m pytest -q -p no:cacheprovider test/gpu/test_triton_kernels_gpu.py -m gpu \
  -k "fused_split_reduce or split_rules or cuda_graph_replay or decode_vs_torch_native" > "$OUT/issue19_fr_pytest.log" 2>&1
rc_tests=$?
timeout -k 10 90 $PY -m pytest -q -p no:cacheprovider test/gpu/test_gpu_correctness.py -m gpu \
  -k "graph_greedy or cuda_graph_replay_equals_eager" >> "$OUT/issue19_fr_pytest.log" 2>&1
rc_tests=$(( rc_tests || $? ))
tail -n 15 "$OUT/issue19_fr_pytest.log"

stage "2. one process: copy-bandwidth floor, then decode per switch setting (off, fr, gg, both; order alternated)"
# benchmark/bench_decode_ab.py: per setting and batch the median synchronized step vs the floor of this run, the host
# time inside ModelRunner.forward around the replay, the replay-only GPU time and the captured graph's node count.
timeout -k 10 200 $PY benchmark/bench_decode_ab.py --out "$OUT" --settings off,fr,gg,both --prefill-tokens 0 \
  > "$OUT/issue19_decode_ab.log" 2>&1
rc_ab=$?
grep -E "captured|bs [0-9]+ |Error|error" "$OUT/issue19_decode_ab.log" | tail -n 16

stage "3. summary (each setting vs the floor measured in the same process)"
cat "$OUT/issue27_decode_ab.md" 2>/dev/null || echo "no table: see $OUT/issue19_decode_ab.log"
echo "issue19 graph nodes: tests rc=$rc_tests decode A/B rc=$rc_ab; total $(( $(date +%s) - t_start )) s"
find "$OUT" -type f | sort
exit $(( rc_tests || rc_ab ))
