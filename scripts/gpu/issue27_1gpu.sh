#!/usr/bin/env bash
# Issue 27, round 3 on ONE H100/H200 (budget 240 s wall, compile included; no serving this round), in priority order:
#   1. GPU tests of the new extend (prefill) attention kernel vs a torch reference on fresh random inputs
#      (test/unit/test_triton_extend_tiles.py runs compiled on a CUDA host: per-arch default + other tile configs,
#      prefixes, GQA, decode rows mixed in, head_dim 128 and 80, page sizes 1 and 16), the backend-level extend/mixed
#      test vs torch_native, and graph replay == eager.
#   2. benchmark/bench_extend_configs.py: the extend kernel's tile configs (the new default first) at one 8K causal
#      prefill vs torch SDPA, same run, errors checked.
#   3. SGLang's CLI at the defaults: python -m sglang.bench_one_batch ... --batch-size 1 32 128 --input-len 1024
#      --output-len 32.
#   4. benchmark/bench_decode_ab.py in one process: copy-bandwidth floor + matmul rate (floors beside step 3's lines);
#      8K-token prefill vs the matmul rate with the kernel breakdown (--breakdown); decode host path old vs new on
#      the same graphs, order alternated; cProfile of 16 decode steps per batch (issue27_host_profile_bs*.txt: where
#      the ~0.4 ms of host time before the forward goes).
#   5. If time is left: benchmark/bench_decode_host.py --device cuda; the memory GPU test (batch 128 x 1K).
#   6. benchmark/issue27_report.py writes $OUT/<date>_issue27_one_gpu.md (the results file, for benchmark/results/).
# Usage (repo root; data at ../shared/data or carried as .sd/): bash scripts/gpu/issue27_1gpu.sh
# Writes under $OUT: <date>_issue27_one_gpu.md, issue27_summary.md, extend_configs.{md,json},
# issue27_decode_ab.{md,json}, issue27_cli.jsonl, host_cuda/decode_host.{md,json}, issue27_*.log.
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"  # cds to the repo root ($root), NVLS off, carried wheels and data
export OUT="${OUT:-/tmp/issue27}"; mkdir -p "$OUT"
unset TRITON_INTERPRET SGLANG_TRITON_DECODE_LEGACY
data="$root/../shared/data"
model="$data/configs/meta-llama--Meta-Llama-3.1-8B"; tok="$data/tokenizers/llama3"
commit="${ISSUE27_COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
exec > >(tee -a "$OUT/issue27_run.log") 2>&1
t_start=$(date +%s); budget=${ISSUE27_BUDGET_S:-235}
left() { echo $(( budget - ($(date +%s) - t_start) )); }
stage() { echo; echo "== $1 ($(( $(date +%s) - t_start )) s elapsed)"; }
cap() { local want=$1 l=$(( $(left) - 10 )); (( l < want )) && want=$l; (( want < 5 )) && want=5; echo "$want"; }
declare -A rc
rc[memtest]=skipped

stage "environment (commit $commit)"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" || true

stage "1. GPU tests: extend kernel vs torch reference (tile configs, prefixes, GQA, pages), backend extend/mixed"
timeout -k 10 "$(cap 75)" $PY -m pytest -q -p no:cacheprovider test/unit/test_triton_extend_tiles.py \
  > "$OUT/issue27_pytest.log" 2>&1
rc[tests]=$?
timeout -k 10 "$(cap 45)" $PY -m pytest -q -p no:cacheprovider -m gpu test/gpu/test_triton_kernels_gpu.py \
  test/gpu/test_gpu_correctness.py -k "extend_and_mixed or cuda_graph_replay_equals_eager" \
  >> "$OUT/issue27_pytest.log" 2>&1
rc[tests]="${rc[tests]}/$?"
grep -E "passed|failed|skipped|Error" "$OUT/issue27_pytest.log" | tail -n 8

stage "2. extend attention tile configs at one 8K causal prefill vs torch SDPA (same run)"
timeout -k 5 "$(cap 50)" $PY benchmark/bench_extend_configs.py --out "$OUT" > "$OUT/issue27_extend.log" 2>&1
rc[extend]=$?
tail -n 14 "$OUT/issue27_extend.log"

stage "3. bench_one_batch at the defaults, batch 1 32 128 x 1024 in / 32 out"
rm -f "$OUT/issue27_cli.jsonl"
timeout -k 10 "$(cap 60)" $PY -m sglang.bench_one_batch --model-path "$model" \
  --load-format dummy --tokenizer-path "$tok" --dtype bfloat16 --device cuda --batch-size 1 32 128 \
  --input-len 1024 --output-len 32 --result-filename "$OUT/issue27_cli.jsonl" > "$OUT/issue27_cli.log" 2>&1
rc[cli]=$?
grep -E "activation reserve|KV cache|Prefill\.|median|Error|error" "$OUT/issue27_cli.log" | tail -n 12

stage "4. floors + 8K prefill vs matmul rate + kernel breakdown + decode host path old vs new (one process)"
timeout -k 10 "$(cap 90)" $PY benchmark/bench_decode_ab.py --out "$OUT" --breakdown --host-profile \
  --cli-results "$OUT/issue27_cli.jsonl" > "$OUT/issue27_decode_ab.log" 2>&1
rc[ab]=$?
grep -E "captured|bs [0-9]+ |breakdown|prefill|Error|error" "$OUT/issue27_decode_ab.log" | tail -n 14
for f in "$OUT"/issue27_host_profile_bs1.txt; do [[ -f "$f" ]] && sed -n 1,16p "$f"; done

rc[host]=skipped
if (( $(left) >= 40 )); then
  stage "5. host part of a decode step on this machine (old vs new, pinned copies)"
  timeout -k 5 "$(cap 30)" $PY benchmark/bench_decode_host.py --device cuda --iters 100 --out "$OUT/host_cuda" \
    > "$OUT/issue27_host.log" 2>&1
  rc[host]=$?
  tail -n 6 "$OUT/issue27_host.log"
fi

if (( $(left) >= 45 )); then
  stage "5b. memory GPU test: batch 128 x 1K at the defaults ($(left) s left)"
  timeout -k 10 "$(cap 40)" $PY -m pytest -q -s -p no:cacheprovider test/gpu/test_memory_budget_gpu.py -m gpu \
    > "$OUT/issue27_gpu_test.log" 2>&1
  rc[memtest]=$?
  grep -E "KV pool|batch 128|largest step|passed|failed|skipped|Error|error" "$OUT/issue27_gpu_test.log" | tail -n 8
fi
rc[serving]="skipped (round 3)"

stage "6. summary and results file"
{
  echo "# Issue 27 round 3 ($(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $commit)"
  echo
  echo "rc: tests=${rc[tests]} bench_one_batch=${rc[cli]} decode_ab=${rc[ab]} host=${rc[host]}" \
    "extend=${rc[extend]} memory_test=${rc[memtest]} serving=${rc[serving]}"
  echo
  if [[ -f "$OUT/issue27_decode_ab.md" ]]; then cat "$OUT/issue27_decode_ab.md"; else
    echo "(no decode table; bench_one_batch lines:)"; grep -E "median" "$OUT/issue27_cli.log"; fi
  echo; cat "$OUT/host_cuda/decode_host.md" 2>/dev/null || echo "(no host micro-benchmark table)"
  echo; cat "$OUT/extend_configs.md" 2>/dev/null || echo "(no extend config table)"
} > "$OUT/issue27_summary.md" 2>&1
cat "$OUT/issue27_summary.md"
$PY benchmark/issue27_report.py --out "$OUT" --commit "$commit" --round 3 \
  --command "bash scripts/gpu/issue27_1gpu.sh (ISSUE27_BUDGET_S=$budget)" || echo "results writer failed rc=$?"
grep -E "^\| (1|32|128) \| (old|new) " "$OUT"/*_issue27_one_gpu.md 2>/dev/null | head -n 6
echo "issue27 total $(( $(date +%s) - t_start )) s"
