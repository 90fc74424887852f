#!/usr/bin/env bash
# Shared start of the issue-27 one-GPU scripts (source it from one: `. "$(dirname "$0")/issue27_common.sh" TAG B`):
# sources device_preamble.sh (repo root, NVLS off, carried wheels and data), creates $OUT (default /tmp/TAG), tees
# everything to $OUT/TAG_run.log, and sets model (Llama-3.1-8B config), commit, gpu (name), budget
# (ISSUE27_BUDGET_S, default B seconds), t_start and, from lib_budget.sh, left (seconds of budget left), stage NAME
# (prints a header with the elapsed time) and cap WANT (WANT capped to the budget left minus 8 s, at least 5).
# Unsets the issue-27 kernel switches so every set of an A/B starts from the defaults.
issue27_tag=$1
. "$(dirname "${BASH_SOURCE[0]}")/device_preamble.sh"
export OUT="${OUT:-/tmp/$issue27_tag}"; mkdir -p "$OUT"
unset TRITON_INTERPRET SGLANG_DECODE_ATTN_SMALL_GRID_TILE SGLANG_DECODE_PDL \
  SGLANG_SKINNY_GEMM SGLANG_DECODE_GEMM_MAX_M SGLANG_DECODE_GEMM_AUTOTUNE SGLANG_DECODE_FUSE_EPILOGUE
model="$root/../shared/data/configs/meta-llama--Meta-Llama-3.1-8B"
commit="$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
exec > >(tee -a "$OUT/${issue27_tag}_run.log") 2>&1
. "$(dirname "${BASH_SOURCE[0]}")/lib_budget.sh"  # left, stage, cap
t_start=$(date +%s); budget_start "${ISSUE27_BUDGET_S:-$2}"; cap_margin=8
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
declare -A rc
