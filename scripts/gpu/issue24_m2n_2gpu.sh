#!/usr/bin/env bash
# Issue 24 item 5 on 2 GPUs (budget <= 100 s): the device-driven M2N transport cuda_push (MegaScale-Infer sec. 5).
#   1. test/gpu/test_m2n_multi_gpu.py[cuda_push-2gpu], rank r on cuda:r, -s (per-phase progress): bytes == torch
#      reference over random row counts incl. 0 (host-header path and device-driven path: row count from the flag
#      word), 10,000 back-to-back messages each way, a CUDA-graph phase (both ranks capture 8 round trips with
#      device row counts, 20 replays back to back, fresh random rows incl. 0 per replay, compared on the device),
#      killed peer fails closed (device wait budget 3 s, host 3 s).
#   2. benchmark/bench_afd.py --mode m2n: one-way latency (round trip / 2, medians of CUDA events, rank r on
#      cuda:r), same run: eager rows cuda_push-dev (send(host_header=False) + recv_device), cuda_push (ZMQ header,
#      as AFD uses it), old cuda_ipc, NCCL send/recv; CUDA-graph rows: K=20 round trips captured per graph for
#      cuda_push-dev and for NCCL send/recv alike, replayed in lockstep (replay time / 2K, median of 20 replays);
#      32/128/512 KB; ratio vs the <= 0.5x NCCL target.
# Output: $OUT/issue24_m2n.md (summary + tables), $OUT/<step>.log. Usage: bash scripts/gpu/issue24_m2n_2gpu.sh
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
start=$SECONDS
out="${OUT:-/tmp/issue24_m2n}"; mkdir -p "$out"
declare -A status
step() {  # step NAME TIMEOUT_S CMD... : run, log to $out/NAME.log, record the exit status and seconds
  local name="$1" t="$2"; shift 2
  echo "== $name (timeout ${t}s, at $(( SECONDS - start ))s)"
  local t0=$SECONDS
  timeout -k 3 "$t" "$@" > "$out/$name.log" 2>&1; local rc=$?
  status[$name]="$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc") in $(( SECONDS - t0 )) s"
  tail -n 25 "$out/$name.log"
}
gpus=$("$PY" -c 'import torch; n = torch.cuda.device_count()
print(f"{n} x {torch.cuda.get_device_name(0)}" if n else "no GPU")' 2>&1 | tail -1)
echo "GPUs: $gpus; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') (may be stale on the device copy)"
step m2n_push_test 52 "$PY" -m pytest -s -q "test/gpu/test_m2n_multi_gpu.py::test_m2n_one_rank_per_gpu[cuda_push-2gpu]" \
  -p no:cacheprovider
step m2n_latency 44 "$PY" benchmark/bench_afd.py --mode m2n --device cuda --transport cuda_push-dev,cuda_push,cuda_ipc \
  --iters 40 --warmup 10 --graph-k 20 --graph-replays 20 --sizes-kb 32 128 512 --timeout 38 --results-dir "$out"
{
  echo "# Issue 24 item 5: device-driven M2N (cuda_push) on $gpus ($(date -u +%F' '%H:%M) UTC)"
  echo; echo "| step | status |"; echo "|---|---|"
  for k in m2n_push_test m2n_latency; do echo "| $k | ${status[$k]:-not run} |"; done
  echo; echo "## one rank per GPU (rank 0's progress)"; echo
  grep -h -E "^\[m2n|passed|failed|skipped|Error|assert" "$out/m2n_push_test.log" 2>/dev/null | tail -20 | sed 's/^/    /'
  echo; echo "## M2N one-way latency vs NCCL send/recv (same run; target: ratio <= 0.5x at every size)"; echo
  echo '`python benchmark/bench_afd.py --mode m2n --device cuda --transport cuda_push-dev,cuda_push,cuda_ipc --iters 40 --warmup 10 --graph-k 20 --graph-replays 20 --sizes-kb 32 128 512`'
  echo; grep -h -E "^\||^Physical" "$out/m2n_latency.log" 2>/dev/null; grep -h -E "Error|error" "$out/m2n_latency.log" 2>/dev/null | tail -5
} > "$out/issue24_m2n.md"
echo "== summary ($(( SECONDS - start )) s)"; cat "$out/issue24_m2n.md"
