#!/usr/bin/env bash
# Issue 24 item 5 (M2N one-way latency <= 0.5x NCCL send/recv at 32-512 KB) on 2 GPUs; whole script <= 90 s,
# compile included (ISSUE24_M2N_LAT_BUDGET overrides). The low-latency protocol of cuda_push (cuda_push_ll:
# sgl_kernel/m2n/ll_kernels.py, tag + data in one 8-byte word, no flag / fence / arrival on the critical path).
#   1. correctness first: test/gpu/test_m2n_multi_gpu.py::test_m2n_one_rank_per_gpu[cuda_push_ll-2gpu], rank r on
#      cuda:r: bytes == torch reference over random row counts incl. 0 (host-header and device paths), 10,000
#      back-to-back messages each way, CUDA-graph replays with device row counts (fresh random rows incl. 0 per
#      replay), killed peer -> TimeoutError within the 3 s device budget.
#   2. latency: benchmark/afd/bench.py --mode m2n, one-way = round trip / 2, rank r on cuda:r, same run: eager and
#      CUDA-graph (K=20 round trips per graph, median of 20 replays) rows of cuda_push_ll-dev and cuda_push-dev (the
#      flag protocol, for A/B), NCCL send/recv eager and graphed, the raw LL floor (one store kernel + one spin kernel
#      per hop, no M2N bookkeeping; graphed) and the copy-engine reference; 32/128/512 KB; ratio vs the 0.5x target.
# Output: $OUT/issue24_m2n_lat.md (summary + tables), $OUT/<step>.log. The steps are issue24_m2n_2gpu.sh's with
# ISSUE24_M2N_PROTOCOL=ll. Usage: bash scripts/gpu/issue24_m2n_lat_2gpu.sh
set -uo pipefail
. "$(dirname "$0")/device_preamble.sh"
ISSUE24_M2N_PROTOCOL=ll exec bash "$(dirname "$0")/issue24_m2n_2gpu.sh" "$@"
