#!/usr/bin/env bash
# Issue 24, round 1 on 2 GPUs (budget 150 s): KVDirect/MegaScale-Infer across real GPUs.
#   1. M2N with one rank per GPU (test/gpu/test_m2n_multi_gpu.py): CUDA-IPC bytes == inline over random row
#      counts incl. 0, 10,000 back-to-back messages, a killed peer failing closed; NIXL variant (skips w/o nixl).
#   2. Role-aware construction: Qwen3-30B-A3B (config, --load-format dummy, bf16) as 1 attention (GPU 0, no
#      experts built) + 1 FFN worker (GPU 1, experts only), starting and decoding a few steps (bench_afd --setups afd);
#      prints the parameter GiB per worker and GPU 0's peak.
#   3. M2N one-way latency (cuda_ipc, rank r on cuda:r) vs NCCL send/recv at 32-512 KB (medians of CUDA events).
#   4. If time is left: the colocated Qwen3-30B-A3B on GPU 0 with the same shapes (own process) -> AFD vs colocated.
# Usage (repo root, shared data at ../shared/data or carried as .sd): bash scripts/gpu/issue24_2gpu.sh [budget_s]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-135}"; start=$SECONDS  # of the 150 s round: the preamble's wheel install comes first
left() { echo $(( budget - (SECONDS - start) )); }
out="${OUT:-/tmp/issue24}"; mkdir -p "$out"
model=../shared/data/configs/Qwen--Qwen3-30B-A3B
shape=(--model-path "$model" --load-format dummy --device cuda --ffn-workers 1 --micro-batches 2 --batch 32
       --input-len 16 --steps 8 --timeout 60)
declare -A status
step() {  # step NAME TIMEOUT_S CMD... : run, log to $out/NAME.log, record the exit status
  local name="$1" t="$2"; shift 2
  [ "$t" -lt 5 ] && { status[$name]="skipped (no time left)"; echo "== $name skipped"; return; }
  echo "== $name (timeout ${t}s)"
  timeout "$t" "$@" > "$out/$name.log" 2>&1; local rc=$?
  status[$name]=$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc (see $name.log)")
  tail -n 12 "$out/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -4
nixl=$("$PY" -c "from sglang.srt.disaggregation.transfer.base import nixl_available as a; print(a())" 2>&1 | tail -1)
echo "nixl: $nixl"
step m2n_test 50 "$PY" -m pytest -q -x test/gpu/test_m2n_multi_gpu.py -p no:cacheprovider
step afd_qwen3 $(( $(left) * 55 / 100 )) "$PY" benchmark/bench_afd.py --mode decode --setups afd "${shape[@]}" \
  --results-dir "$out"
step m2n_latency $(( $(left) * 45 / 100 )) "$PY" benchmark/bench_afd.py --mode m2n --device cuda --iters 50 \
  --warmup 10 --results-dir "$out"
step colocated_qwen3 $(( $(left) - 3 )) "$PY" benchmark/bench_afd.py --mode decode --setups colocated "${shape[@]}" \
  --results-dir "$out"
{
  echo "# Issue 24 round 1 ($(date -u +%F' '%H:%M) UTC, $("$PY" -c 'import torch; n = torch.cuda.device_count()
print(f"{n} x {torch.cuda.get_device_name(0)}" if n else "no GPU")' 2>&1 | tail -1))"
  echo; echo "nixl available: $nixl"; echo; echo "| step | status |"; echo "|---|---|"
  for k in m2n_test afd_qwen3 m2n_latency colocated_qwen3; do echo "| $k | ${status[$k]:-not run} |"; done
  echo; grep -h -E "passed|failed|skipped|error|Error" "$out/m2n_test.log" 2>/dev/null | tail -5
  for k in afd_qwen3 m2n_latency colocated_qwen3; do echo; echo "## $k"; grep -h "^|" "$out/$k.log" 2>/dev/null
    grep -h "Measured pipeline" "$out/$k.log" 2>/dev/null; grep -h "Error" "$out/$k.log" 2>/dev/null | tail -2; done
} > "$out/issue24_round1.md"
echo "== summary ($(( SECONDS - start )) s)"; cat "$out/issue24_round1.md"
