#!/usr/bin/env bash
# Issue 25: TokenWeave on the bulk-copy two-shot comm vs TokenWeave on the old comm, TP4 (4 GPUs, one rank per GPU),
# budget 150 s incl. the libtwcomm build (~25 s). Same run, same seeded dummy weights:
#  0. which tw-comm kernel each TokenWeave call gets on this GPU at TP4 (the packaged crossover table,
#     python/sglang/srt/distributed/tw_comm_crossovers.json; H200 x4: overlapped calls of >= ~360 tokens at hidden
#     8192 on p2p_twoshot_bulk; a GPU without a table keeps p2p_twoshot, then tokenweave == tokenweave_oldcomm)
#  1-2. scripts/gpu/issue25_tw_4gpu.sh with TW_EXTRA_VARIANTS=tokenweave_oldcomm: benchmark/tokenweave/bench_layer.py, Llama-3.3-70B
#     config cut to 4 layers, dummy bf16, T = 1024 2048 4096 8192, variants nccl nccl_symm nocomm tokenweave (the
#     server's default comm: bulk) tokenweave_oldcomm (TwCommConfig.bulk_twoshot=False: the pre-bulk two-shot),
#     eager and every forward CUDA-graphed; eager next-token logits of every variant vs nccl's and every graph's vs
#     its eager forward (the correctness section); the layer table has tokenweave / tokenweave_oldcomm, the graph
#     table its graph ratio. The TP2 executor test (issue25_tw_4gpu.sh step 3) is skipped here.
# Tables: $OUT/issue25_tw_bulk.md (+ $OUT/issue25_tw_bulk_select.txt). Usage (repo root):
#   bash scripts/gpu/issue25_tw_bulk_4gpu.sh [seconds, default 150]
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
budget="${1:-150}"; start=$SECONDS
out="${OUT:-/tmp/issue25_tw}"; mkdir -p "$out"

echo "== 0. tw-comm choice per TokenWeave call at TP4 (table of this GPU; T = a split's tokens, hidden 8192)"
timeout --kill-after=5 20 "$PY" - > "$out/issue25_tw_bulk_select.txt" 2>&1 <<'PYEOF'
import torch
from sglang.srt.distributed.tw_comm import TwCommConfig, select_backend, staging_bytes
from sglang.srt.distributed.tw_comm_tuning import describe, load_crossovers
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
table = load_crossovers(gpu, 4)
print(f"{gpu} x4: plain {describe(table.plain)}; overlap {describe(table.overlap)}")
cap = staging_bytes(16384, 8192, 4)[0]
for bulk in (None, False):
    cfg = TwCommConfig(crossovers=table, bulk_twoshot=bulk)
    sel = lambda T, ovl: select_backend(T, 8192, 4, config=cfg, overlap=ovl, capacity_bytes=cap).value
    picks = {T: (sel(T, True), sel(T, False)) for T in (512, 1024, 2048, 4096, 8192)}
    name = "tokenweave (default)" if bulk is None else "tokenweave_oldcomm"
    print(f"{name}: " + ", ".join(f"T={T} overlap {o} / plain {p}" for T, (o, p) in picks.items()))
PYEOF
echo "rc=$?"; cat "$out/issue25_tw_bulk_select.txt"

left=$(( budget - (SECONDS - start) ))
TW_EXTRA_VARIANTS="tokenweave_oldcomm" TW_RESULT=issue25_tw_bulk.md TW_SKIP_TP2_TEST=1 TW_BENCH_S=$(( left - 35 )) \
  bash "$(dirname "$0")/issue25_tw_4gpu.sh" "$left"
echo "== issue25_tw_bulk done ($(( SECONDS - start )) s of $budget s)"
grep -E "tokenweave_oldcomm|^- T=" "$out/issue25_tw_bulk.md" 2>/dev/null | head -12
