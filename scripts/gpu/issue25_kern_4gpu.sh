#!/usr/bin/env bash
# Issue 25 (TokenWeave sec. 3-4: the communication kernel on a bounded CTA count): tw-comm's bulk-copy two-shot
# fused AllReduce + residual + RMSNorm (p2p_twoshot_bulk, cp.async.bulk through a shared ring) on 4 GPUs, one rank
# per GPU; on a 2-GPU machine (or CUDA_VISIBLE_DEVICES=0,1) the world-4 steps skip and world 2 runs. <= 150 s.
#   1. build libtwcomm (nvcc, sm_90a)
#   2. correctness, world 4 then 2: the bulk two-shot vs the fp32 torch reference on fresh random inputs, outputs
#      NaN-poisoned (hidden 8192 bf16, T = 1 / 128 / 1024 / 8192, 8-132 CTAs, full and sharded residual; odd
#      shapes, fp16; interleaved with the other two-shots; CUDA-graph replay; 360 back-to-back calls; ranks equal)
#   3. timing, world 4 then 2, T = 1024 / 4096 / 8192: twoshot_sharded, twoshot_pipe_sharded, twoshot_bulk (full
#      residual) and twoshot_bulk_sharded at 8 / 16 / 24 / 32 / all CTAs vs NCCL + fused norm, NCCL symmetric +
#      norm and torch symm-mem + norm, line-rate floor; CUDA-graph replay, medians of CUDA events after warm-up
# Output: $OUT/issue25_kern.md (compact tables), $OUT/bench_w*/ (full reports), one log per step.
# Usage: OUT=/tmp/x bash scripts/gpu/issue25_kern_4gpu.sh [budget s, default 150]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
. "$(dirname "$0")/lib_budget.sh"; budget_start "${1:-150}"  # left, step (returns the exit code), summary
out="${OUT:-/tmp/issue25_kern}"; mkdir -p "$out"
step_reserve=2 step_min=5 step_kill=3 step_item="- "  # each step: limit cut to what is left - 2 s
step_show() { grep -E "passed|failed|skipped|Error|\[tw-comm gpu\]|done:" "$1" | tail -8; }
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
ngpu="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
echo "$ngpu x $gpu; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
worlds=(); (( ngpu >= 4 )) && worlds+=(4); (( ngpu >= 2 )) && worlds+=(2)

step build 50 "$PY" -c "from sgl_kernel.tw_comm.build import build_library; print(build_library())"
bench() {  # bench WORLD SECONDS METHODS: the CTA sweep of one world size
  mkdir -p "$out/bench_w$1"
  step "bench_w$1" "$2" "$PY" benchmark/comm/bench_allreduce_rmsnorm.py --worlds "$1" --tokens 1024,4096,8192 \
    --variants "$3" --no-ce --sweep-min-tokens 100000000 --chunk-sweep '' --ctas 8,16,24,32,all --cta-variants "$3" \
    --calls-per-graph 3 --replays 5 --out "$out/bench_w$1" --tag _issue25kern
}
limits=(35 45 30 40)  # test / bench seconds at world 4, then at world 2 (the step cuts to what is left)
for w in "${worlds[@]}"; do
  [ "$w" = 4 ] && lt=${limits[0]} lb=${limits[1]} || lt=${limits[2]} lb=${limits[3]}
  methods=twoshot_sharded,twoshot_pipe_sharded,twoshot_bulk,twoshot_bulk_sharded
  # a failing (or faulting) bulk kernel would take the whole timing run with it: then time the others alone
  TW_COMM_QUICK=1 step "test_w$w" "$lt" "$PY" -m pytest -q -p no:cacheprovider \
    "test/gpu/test_tw_comm_gpu.py::test_tw_comm_bulk_gpu[$w]" || methods=twoshot_sharded,twoshot_pipe_sharded
  bench "$w" "$lb" "$methods"
done

res="$out/issue25_kern.md"
{
  echo "# issue 25: bulk-copy two-shot (p2p_twoshot_bulk) at few CTAs on $ngpu x $gpu ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo "- command: \`OUT=... bash scripts/gpu/issue25_kern_4gpu.sh $budget\`;" \
    "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); NVLink multicast off in every process"
  echo "- times: us per call, CUDA-graph replay (3 calls per graph, 2 warm-up replays), median of 5 replays" \
    "timed by CUDA events, max over ranks; floor = 2(n-1)/n x bytes / 450 GB/s"
  for w in "${worlds[@]}"; do
    echo; echo "## world $w correctness (fp32 torch reference, fresh random inputs)"
    grep -hE "passed|failed|skipped|Error|\[tw-comm gpu\]" "$out/test_w$w.log" 2>/dev/null | tail -6
    echo; echo "## world $w timing"
    f="$(ls "$out/bench_w$w"/tw_comm_allreduce_rmsnorm_*_issue25kern.md 2>/dev/null | tail -1)"
    if [ -n "$f" ]; then
      awk '/^CTA sweep/{f=1} f{print} f&&/^$/{if(++n==2)exit}' "$f"
      echo; echo "Defaults (128 CTAs) and baselines:"; echo
      awk '/^\| world \| T \| floor \| baseline/{f=1} f&&/^$/{exit} f{print}' "$f"
      grep -E "^- " "$f" | head -4
    else
      echo "(no report; see bench_w$w.log)"; tail -5 "$out/bench_w$w.log" 2>/dev/null
    fi
  done
  echo; echo "## steps"; printf '%s\n' "${summary[@]}"
} > "$res"
echo "== summary (budget ${budget} s, used $(( SECONDS - start )) s; $ngpu x $gpu)"; printf '%s\n' "${summary[@]}"
cat "$res"
