// (a) P2P one-shot AllReduce (+ residual add + RMSNorm), and the local fused add+RMSNorm kernel.
//
// Push design: block b reads its rows of the caller's x (no copy into a symmetric buffer needed) and stores
// them with 16-byte stores into every rank's staging slot [src = this rank][row]; one epoch-tagged flag barrier
// per block; then each rank reduces all ranks' copies of its rows from LOCAL memory in a fixed rank order (so
// every rank computes bit-identical results), adds the residual and applies RMSNorm with the row in registers.
// One NVLink crossing and one barrier: the latency winner at small token counts (TokenWeave section 3.3 uses
// the one-shot form for small batches too).
#include "host_common.h"

namespace twcomm {

template <typename T, int N, int VPT, bool NORM>
__global__ void __launch_bounds__(kThreads) oneshot_kernel(KParams p) {
  const uint32_t e = read_epoch(p.ctrl);
  const int slot = p.fixed_slot >= 0 ? p.fixed_slot : (int)(e & 1u);
  const int nv = p.hidden / 8;
  const uint4* x = static_cast<const uint4*>(p.x);
  // Phase 1: push own rows to every rank (self included) at [src = rank][row].
  for (int row = blockIdx.x; row < p.tokens; row += gridDim.x) {
    uint4 v[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * kThreads;
      if (j < nv) v[k] = x[(size_t)row * nv + j];
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int q = (p.rank + i) % N;
      uint4* dst = reinterpret_cast<uint4*>(slot_base(p, q, slot)) + ((size_t)p.rank * p.tokens + row) * nv;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int j = threadIdx.x + k * kThreads;
        if (j < nv) dst[j] = v[k];
      }
    }
  }
  block_barrier(p, 0, e);
  // Phase 2: local reduce in rank order 0..N-1, residual add, RMSNorm.
  const uint4* mine = reinterpret_cast<const uint4*>(slot_base(p, p.rank, slot));
  uint4 w[VPT];
  load_weight<VPT, NORM>(w, p.weight, nv);
  uint4* const res_base = static_cast<uint4*>(p.residual);
  for (int row = blockIdx.x; row < p.tokens; row += gridDim.x) {
    float acc[VPT][8];
    uint4 rv[VPT];
    zero_acc(acc);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * kThreads;
      if (j < nv) {
        uint4 v[N];
        if (NORM) rv[k] = res_base[(size_t)row * nv + j];
#pragma unroll
        for (int q = 0; q < N; ++q) v[q] = __ldcg(mine + ((size_t)q * p.tokens + row) * nv + j);
#pragma unroll
        for (int q = 0; q < N; ++q) add_vec<T>(acc[k], v[q]);
      }
    }
    finish_row<T, VPT, NORM>(acc, nv, rv, w, p.weight, NORM ? res_base + (size_t)row * nv : nullptr, p.eps,
                             static_cast<uint4*>(p.out) + (size_t)row * nv, nullptr, nullptr);
  }
  finish_epoch(p.ctrl, e);
}

template <typename T, int VPT>
__global__ void __launch_bounds__(kThreads) add_rmsnorm_kernel(KParams p) {
  const int nv = p.hidden / 8;
  uint4 w[VPT];
  load_weight<VPT, true>(w, p.weight, nv);
  uint4* const res_base = static_cast<uint4*>(p.residual);
  for (int row = blockIdx.x; row < p.tokens; row += gridDim.x) {
    float acc[VPT][8];
    uint4 rv[VPT];
    zero_acc(acc);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * kThreads;
      if (j < nv) {
        rv[k] = res_base[(size_t)row * nv + j];
        add_vec<T>(acc[k], static_cast<const uint4*>(p.x)[(size_t)row * nv + j]);
      }
    }
    finish_row<T, VPT, true>(acc, nv, rv, w, p.weight, res_base + (size_t)row * nv, p.eps,
                             static_cast<uint4*>(p.out) + (size_t)row * nv, nullptr, nullptr);
  }
}

template <typename T, int N, bool NORM>
static void launch_oneshot_vpt(const KParams& p, int grid, cudaStream_t s) {
  switch (vecs_per_thread(p.hidden)) {
    case 1: oneshot_kernel<T, N, 1, NORM><<<grid, kThreads, 0, s>>>(p); break;
    case 2: oneshot_kernel<T, N, 2, NORM><<<grid, kThreads, 0, s>>>(p); break;
    default: oneshot_kernel<T, N, 4, NORM><<<grid, kThreads, 0, s>>>(p); break;
  }
}

template <typename T, bool NORM>
static void launch_oneshot_n(const KParams& p, int grid, cudaStream_t s) {
  switch (p.world) {
    case 2: launch_oneshot_vpt<T, 2, NORM>(p, grid, s); break;
    case 4: launch_oneshot_vpt<T, 4, NORM>(p, grid, s); break;
    default: launch_oneshot_vpt<T, 8, NORM>(p, grid, s); break;
  }
}

int run_oneshot(tw_workspace* ws, const void* x, void* residual, const void* weight, void* out, int tokens,
                int hidden, int dtype, float eps, int max_blocks, bool norm, void* stream) {
  if (!ws || !ws->opened) return set_error(TW_ERR_STATE, "workspace is not opened");
  int rc = check_common(tokens, hidden, dtype, max_blocks, x, residual, weight, out);
  if (rc) return rc;
  if (!x || !out || (norm && (!residual || !weight))) return set_error(TW_ERR_ARG, "null tensor pointer");
  if (tokens == 0) return TW_OK;
  const size_t need = (size_t)ws->world * tokens * hidden * 2;
  if (need > ws->region_bytes)
    return set_error(TW_ERR_ARG, "one-shot needs %zu staging bytes (world*tokens*hidden*2) > capacity %zu; "
                     "use two-shot or a larger workspace", need, ws->region_bytes);
  DeviceGuard guard(ws->device);
  KParams p = make_params(ws);
  p.x = x;
  p.residual = residual;
  p.weight = weight;
  p.out = out;
  p.tokens = tokens;
  p.hidden = hidden;
  p.eps = eps;
  const int grid = tokens < max_blocks ? tokens : max_blocks;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == TW_BF16) {
    norm ? launch_oneshot_n<__nv_bfloat16, true>(p, grid, s) : launch_oneshot_n<__nv_bfloat16, false>(p, grid, s);
  } else {
    norm ? launch_oneshot_n<__half, true>(p, grid, s) : launch_oneshot_n<__half, false>(p, grid, s);
  }
  TW_CUDA_CHECK(cudaGetLastError());
  return TW_OK;
}

}  // namespace twcomm

using namespace twcomm;

extern "C" {

int tw_oneshot_allreduce_rmsnorm(tw_workspace* ws, const void* x, void* residual, const void* weight, void* out,
                                 int tokens, int hidden, int dtype, float eps, int max_blocks, void* stream) {
  return run_oneshot(ws, x, residual, weight, out, tokens, hidden, dtype, eps, max_blocks, true, stream);
}

int tw_fused_add_rmsnorm(const void* x, void* residual, const void* weight, void* out, int tokens, int hidden,
                         int dtype, float eps, int max_blocks, void* stream) {
  int rc = check_common(tokens, hidden, dtype, max_blocks, x, residual, weight, out);
  if (rc) return rc;
  if (!x || !residual || !weight || !out) return set_error(TW_ERR_ARG, "null tensor pointer");
  if (tokens == 0) return TW_OK;
  KParams p;
  memset(&p, 0, sizeof(p));
  p.x = x;
  p.residual = residual;
  p.weight = weight;
  p.out = out;
  p.tokens = tokens;
  p.hidden = hidden;
  p.eps = eps;
  p.nchunks = 1;
  const int grid = tokens < max_blocks ? tokens : max_blocks;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int vpt = vecs_per_thread(hidden);
  if (dtype == TW_BF16) {
    if (vpt == 1) add_rmsnorm_kernel<__nv_bfloat16, 1><<<grid, kThreads, 0, s>>>(p);
    else if (vpt == 2) add_rmsnorm_kernel<__nv_bfloat16, 2><<<grid, kThreads, 0, s>>>(p);
    else add_rmsnorm_kernel<__nv_bfloat16, 4><<<grid, kThreads, 0, s>>>(p);
  } else {
    if (vpt == 1) add_rmsnorm_kernel<__half, 1><<<grid, kThreads, 0, s>>>(p);
    else if (vpt == 2) add_rmsnorm_kernel<__half, 2><<<grid, kThreads, 0, s>>>(p);
    else add_rmsnorm_kernel<__half, 4><<<grid, kThreads, 0, s>>>(p);
  }
  TW_CUDA_CHECK(cudaGetLastError());
  return TW_OK;
}

}  // extern "C"
