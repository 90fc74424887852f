// (c) Copy-engine AllReduce + residual add + RMSNorm: the ReduceScatter and AllGather data movement runs on
// the GPU's copy engines (cudaMemcpyAsync between IPC-mapped peer buffers, one side stream per peer so several
// engines run at once), and only the reduce + residual + RMSNorm kernel uses SMs, at most `max_blocks` of them.
// This is what lets the fused op overlap the other token split's compute (TokenWeave section 3.3 / 4) with a
// small SM footprint.
//
// Pipelined over C row chunks of every rank's token range (C = min(kCeMaxChunks, ceil(T/N))), all capturable:
//   barrier kernel (everyone finished the previous call, so slot 0 may be overwritten)
//   side stream d (peer q = rank+d): push chunk 0..C-1 of x rows of q's range -> q's slot-0 input region
//   for each chunk c on the caller's stream: wait chunk-c pushes; reduce kernel on chunk c (per-block barrier at
//     entry: peers' chunk-c pushes landed); barrier kernel (chunk c normed everywhere); side streams pull chunk
//     c's normed (and residual unless sharded) rows of every peer into out/residual, overlapping chunk c+1.
//   join all side streams.
#include "host_common.h"

using namespace twcomm;

extern "C" int tw_ce_allreduce_rmsnorm(tw_workspace* ws, const void* x, void* residual, const void* weight,
                                       void* out, int tokens, int hidden, int dtype, float eps, int max_blocks,
                                       int residual_sharded, void* stream) {
  KParams p;
  int grid = 0;
  int rc = prepare_twoshot(ws, x, residual, weight, out, tokens, hidden, dtype, eps, max_blocks, residual_sharded,
                           true, &p, &grid);
  if (rc || tokens == 0) return rc;
  DeviceGuard guard(ws->device);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int n = ws->world;
  const int stride = (tokens + n - 1) / n;
  const int chunks = stride < kCeMaxChunks ? stride : kCeMaxChunks;
  const int chunk_rows = (stride + chunks - 1) / chunks;
  grid = chunk_rows < max_blocks ? chunk_rows : max_blocks;  // identical on every rank
  const size_t row_bytes = (size_t)hidden * 2;
  p.fixed_slot = 0;
  p.nchunks = chunks;
  auto region_in = [&](int q) { return ws->peer_base[q] + kPadBytes; };
  auto region_out = [&](int q) { return ws->peer_base[q] + kPadBytes + ws->region_bytes; };
  auto start = [&](int q) { return owned_start(tokens, n, q); };
  // local row range [lo, hi) of chunk c of rank q's token range
  auto chunk_lo = [&](int q, int c) { return (int)((long long)(start(q + 1) - start(q)) * c / chunks); };

  if ((rc = launch_barrier(ws, s))) return rc;
  TW_CUDA_CHECK(cudaEventRecord(ws->fork, s));
  for (int d = 1; d < n; ++d) {
    const int q = (ws->rank + d) % n;
    TW_CUDA_CHECK(cudaStreamWaitEvent(ws->side[d], ws->fork, 0));
    for (int c = 0; c < chunks; ++c) {
      const int lo = chunk_lo(q, c), hi = chunk_lo(q, c + 1);
      if (hi > lo) {
        TW_CUDA_CHECK(cudaMemcpyAsync(region_in(q) + ((size_t)ws->rank * stride + lo) * row_bytes,
                                      static_cast<const char*>(x) + (size_t)(start(q) + lo) * row_bytes,
                                      (size_t)(hi - lo) * row_bytes, cudaMemcpyDeviceToDevice, ws->side[d]));
      }
      TW_CUDA_CHECK(cudaEventRecord(ws->push_done[c][d], ws->side[d]));
    }
  }
  for (int c = 0; c < chunks; ++c) {
    for (int d = 1; d < n; ++d) TW_CUDA_CHECK(cudaStreamWaitEvent(s, ws->push_done[c][d], 0));
    p.chunk = c;
    if ((rc = launch_twoshot(ws, p, dtype, true, false, false, grid, s))) return rc;
    if ((rc = launch_barrier(ws, s))) return rc;
    TW_CUDA_CHECK(cudaEventRecord(ws->pull_fork[c], s));
    for (int d = 1; d < n; ++d) {
      const int q = (ws->rank + d) % n;
      const int lo = chunk_lo(q, c), hi = chunk_lo(q, c + 1);
      TW_CUDA_CHECK(cudaStreamWaitEvent(ws->side[d], ws->pull_fork[c], 0));
      if (hi <= lo) continue;
      const size_t bytes = (size_t)(hi - lo) * row_bytes;
      TW_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out) + (size_t)(start(q) + lo) * row_bytes,
                                    region_out(q) + (size_t)lo * row_bytes, bytes, cudaMemcpyDeviceToDevice,
                                    ws->side[d]));
      if (!residual_sharded)
        TW_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(residual) + (size_t)(start(q) + lo) * row_bytes,
                                      region_out(q) + ((size_t)stride + lo) * row_bytes, bytes,
                                      cudaMemcpyDeviceToDevice, ws->side[d]));
    }
  }
  for (int d = 1; d < n; ++d) {
    TW_CUDA_CHECK(cudaEventRecord(ws->join[d], ws->side[d]));
    TW_CUDA_CHECK(cudaStreamWaitEvent(s, ws->join[d], 0));
  }
  return TW_OK;
}
