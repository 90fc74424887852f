#!/usr/bin/env bash
# Issue 24, round 2 on 2 GPUs (budget 150 s): CUDA-IPC M2N across real GPUs, then AFD and latency.
#   1. M2N with one rank per GPU (test/gpu/test_m2n_multi_gpu.py, -s: per-phase progress): CUDA-IPC bytes ==
#      inline over random row counts incl. 0, 10,000 back-to-back messages, a killed peer failing closed; NIXL.
#   2. scripts/gpu/m2n_ipc_probe.py: which CUDA-IPC strategy (ring/event opened on own vs peer device, torch vs
#      raw cudaIpc, event vs host sync) delivers equal bytes; its RECOMMEND line (the best working one, own/own
#      first) sets SGL_M2N_IPC_MEM/EVENT for steps 3-5.
#   3. AFD Qwen3-30B-A3B (config, --load-format dummy, bf16): 1 attention (GPU 0, no experts built) + 1 FFN worker
#      (GPU 1), batch 32, 2 untimed + 4 timed decode steps; parameter GiB per worker, GPU 0 peak.
#   4. M2N one-way latency (cuda_ipc, rank r on cuda:r) vs NCCL send/recv, 32/128/512 KB (medians of CUDA events).
#   5. If time is left: colocated Qwen3-30B-A3B on GPU 0, same shapes (warm-up excluded).
# Usage (repo root, shared data at ../shared/data or carried as .sd): bash scripts/gpu/issue24_2gpu.sh [budget_s]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-140}"; start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/issue24}"; mkdir -p "$out"
model=../shared/data/configs/Qwen--Qwen3-30B-A3B
shape=(--model-path "$model" --load-format dummy --device cuda --ffn-workers 1 --micro-batches 2 --batch 32
       --input-len 16 --steps 4 --decode-warmup 2 --timeout 45)
declare -A status
step() {  # step NAME TIMEOUT_S CMD... : run, log to $out/NAME.log, record the exit status and seconds
  local name="$1" t="$2"; shift 2
  [ "$t" -lt 5 ] && { status[$name]="skipped (no time left)"; echo "== $name skipped"; return; }
  echo "== $name (timeout ${t}s, at $(( SECONDS - start ))s)"
  local t0=$SECONDS
  timeout -k 3 "$t" "$@" > "$out/$name.log" 2>&1; local rc=$?
  status[$name]="$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc") in $(( SECONDS - t0 )) s"
  tail -n 15 "$out/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -4
nixl=$("$PY" -c "from sglang.srt.disaggregation.transfer.base import nixl_available as a; print(a())" 2>&1 | tail -1)
echo "nixl: $nixl"
m2n=test/gpu/test_m2n_multi_gpu.py::test_m2n_one_rank_per_gpu
# one step per transport, each with its own bound (the test's BOUNDS + pytest start-up), so one cannot eat the others'
step m2n_cuda_ipc 36 "$PY" -m pytest -s -q "$m2n[cuda_ipc-2gpu]" -p no:cacheprovider
step m2n_inline 22 "$PY" -m pytest -s -q "$m2n[inline-2gpu]" -p no:cacheprovider
step m2n_nixl 30 "$PY" -m pytest -s -q "$m2n[nixl-2gpu]" -p no:cacheprovider
cat "$out"/m2n_cuda_ipc.log "$out"/m2n_inline.log "$out"/m2n_nixl.log > "$out/m2n_test.log" 2>/dev/null
step ipc_probe 28 "$PY" scripts/gpu/m2n_ipc_probe.py --budget-s 22 --out "$out/issue24_ipc_probe.md"
rec=$(grep -h "^RECOMMEND SGL" "$out/ipc_probe.log" 2>/dev/null | tail -1 | sed 's/^RECOMMEND //')
[ -n "$rec" ] && export $rec  # the probe's best working strategy (own/own first) for the steps below
echo "CUDA IPC strategy for the next steps: mem=${SGL_M2N_IPC_MEM:-own} event=${SGL_M2N_IPC_EVENT:-own}"
step afd_qwen3 $(( $(left) * 60 / 100 )) "$PY" benchmark/afd/bench.py --mode decode --setups afd "${shape[@]}" \
  --results-dir "$out"
step m2n_latency $(( $(left) > 30 ? 30 : $(left) )) "$PY" benchmark/afd/bench.py --mode m2n --device cuda \
  --iters 30 --warmup 5 --sizes-kb 32 128 512 --timeout 25 --results-dir "$out"
step colocated_qwen3 $(( $(left) - 2 )) "$PY" benchmark/afd/bench.py --mode decode --setups colocated "${shape[@]}" \
  --results-dir "$out"
{
  echo "# Issue 24 round 2 ($(date -u +%F' '%H:%M) UTC, $("$PY" -c 'import torch; n = torch.cuda.device_count()
print(f"{n} x {torch.cuda.get_device_name(0)}" if n else "no GPU")' 2>&1 | tail -1))"
  echo; echo "nixl available: $nixl; CUDA IPC strategy after the probe: mem=${SGL_M2N_IPC_MEM:-own}" \
    "event=${SGL_M2N_IPC_EVENT:-own}"
  echo; echo "| step | status |"; echo "|---|---|"
  for k in m2n_cuda_ipc m2n_inline m2n_nixl ipc_probe afd_qwen3 m2n_latency colocated_qwen3; do echo "| $k | ${status[$k]:-not run} |"; done
  echo; grep -h -E "^\[m2n|passed|failed|skipped|Error" "$out/m2n_test.log" 2>/dev/null | tail -12
  echo; grep -h -E "^\||^RECOMMEND" "$out/ipc_probe.log" 2>/dev/null | tail -12
  for k in afd_qwen3 m2n_latency colocated_qwen3; do echo; echo "## $k"; grep -h "^|" "$out/$k.log" 2>/dev/null
    grep -h "Measured pipeline" "$out/$k.log" 2>/dev/null; grep -h "Error" "$out/$k.log" 2>/dev/null | tail -3; done
} > "$out/issue24_round2.md"
echo "== summary ($(( SECONDS - start )) s)"; cat "$out/issue24_round2.md"
