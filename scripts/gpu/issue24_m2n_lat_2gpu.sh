#!/usr/bin/env bash
# Issue 24 item 5 (M2N one-way latency <= 0.5x NCCL send/recv at 32-512 KB) on 2 GPUs; whole script <= 90 s,
# compile included (ISSUE24_M2N_LAT_BUDGET overrides). The low-latency protocol of cuda_push (cuda_push_ll:
# sgl_kernel/m2n/ll_kernels.py, tag + data in one 8-byte word, no flag / fence / arrival on the critical path).
#   1. correctness first: test/gpu/test_m2n_multi_gpu.py::test_m2n_one_rank_per_gpu[cuda_push_ll-2gpu], rank r on
#      cuda:r: bytes == torch reference over random row counts incl. 0 (host-header and device paths), 10,000
#      back-to-back messages each way, CUDA-graph replays with device row counts (fresh random rows incl. 0 per
#      replay), killed peer -> TimeoutError within the 3 s device budget.
#   2. latency: benchmark/bench_afd.py --mode m2n, one-way = round trip / 2, rank r on cuda:r, same run: eager and
#      CUDA-graph (K=20 round trips per graph, median of 20 replays) rows of cuda_push_ll-dev and cuda_push-dev (the
#      flag protocol, for A/B), NCCL send/recv eager and graphed, the raw LL floor (one store kernel + one spin kernel
#      per hop, no M2N bookkeeping; graphed) and the copy-engine reference; 32/128/512 KB; ratio vs the 0.5x target.
# Output: $OUT/issue24_m2n_lat.md (summary + tables), $OUT/<step>.log. Usage: bash scripts/gpu/issue24_m2n_lat_2gpu.sh
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$(dirname "$0")/lib_budget.sh"; budget_start "${ISSUE24_M2N_LAT_BUDGET:-90}"
out="${OUT:-/tmp/issue24_m2n_lat}"; mkdir -p "$out"
# lib_budget.sh step: limit cut to what is left - 1 s, not run under 8 s, log $out/NAME.log, last 20 lines
step_reserve=1 step_min=8 step_kill=2 step_tail=20
gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') x $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
echo "GPUs: $gpus; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') (may be stale on the device copy)"
step ll_test 40 "$PY" -m pytest -s -v "test/gpu/test_m2n_multi_gpu.py::test_m2n_one_rank_per_gpu[cuda_push_ll-2gpu]" \
  -p no:cacheprovider
bench_t=$(( $(left) - 1 ))
cmd=(benchmark/bench_afd.py --mode m2n --device cuda --transport cuda_push_ll-dev,cuda_push-dev --iters 20 --warmup 5
     --graph-k 20 --graph-replays 20 --sizes-kb 32 128 512)
step ll_latency "$bench_t" "$PY" "${cmd[@]}" --timeout $(( bench_t > 12 ? bench_t - 5 : 8 )) --results-dir "$out"
{
  echo "# Issue 24 item 5: M2N low-latency protocol (cuda_push_ll) on $gpus ($(date -u +%F' '%H:%M) UTC)"
  echo; echo "| step |"; echo "|---|"
  for k in "${summary[@]}"; do echo "| $k |"; done
  echo; echo "## correctness, one rank per GPU (rank 0's progress)"; echo
  grep -h -E "^\[m2n|PASSED|FAILED|SKIPPED|passed|failed|skipped|Error|assert" "$out/ll_test.log" 2>/dev/null | tail -20 | sed 's/^/    /'
  echo; echo "## one-way latency vs NCCL send/recv (same run; target: ratio <= 0.5x at every size)"; echo
  echo "\`python ${cmd[*]}\`"
  echo; grep -h -E "^\||^Physical|^\[partial\]" "$out/ll_latency.log" 2>/dev/null
  grep -h -E "Error|error" "$out/ll_latency.log" 2>/dev/null | tail -5
} > "$out/issue24_m2n_lat.md"
echo "== summary ($(( SECONDS - start )) s)"; cat "$out/issue24_m2n_lat.md"
