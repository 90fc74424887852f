// (b) P2P two-shot AllReduce + residual add + RMSNorm (TokenWeave, Gond et al. 2025, section 3.3), its plain
// AllReduce form (e), and the reduce kernel reused by the copy-engine variant (c).
//
// Tokens (whole rows) are split across ranks: rank q owns rows [q*T/N, (q+1)*T/N), so any T works and the norm
// of a row needs no cross-rank reduction.
//  1. ReduceScatter by peer stores: block b reads the caller's x rows destined to rank q (row i of q's range,
//     i = b mod grid) and stores them into q's staging slot [src = this rank][i]. The caller's x is read in
//     place: no copy into a symmetric buffer.
//  2. barrier 0 (per block, epoch-tagged flags).
//  3. Reduce own rows from local memory (+ own x), add residual, RMSNorm in registers; write residual/out rows
//     and a copy of the normed row (and of the residual row unless residual_sharded) into the local output
//     region of the slot.
//  4. barrier 1, then AllGather by peer loads: copy every peer's normed rows (and residual rows) straight into
//     the caller's out/residual. Stores-then-loads keeps the caller's tensors non-symmetric (no copy-in or
//     copy-out), at the same NVLink traffic as loads-then-stores: 2 (N-1)/N * S per rank, the line-rate floor,
//     when residual_sharded (TokenWeave keeps the residual sharded between layers).
#include "host_common.h"

namespace twcomm {

constexpr int kUnroll = 8;  // independent 16-byte transfers in flight per thread in the copy phases

// ReduceScatter by peer stores: block b sends rows i = b, b+G, ... of every peer q's token range to q's slot
// [src = this rank][i]. Work is flattened over (row, peer, vector) and unrolled kUnroll deep, so each thread
// keeps kUnroll loads (then stores) in flight: NVLink latency, not the SM count, would otherwise bound it.
template <int N, int U>
__device__ __forceinline__ void push_rows(const KParams& p, int slot, int stride, int nv) {
  const int G = gridDim.x, b = blockIdx.x;
  const int rb = (stride - b + G - 1) / G;
  const int total = rb * (N - 1) * nv;
  const uint4* x = static_cast<const uint4*>(p.x);
  for (int base = threadIdx.x; base < total; base += U * kThreads) {
    uint4 v[U];
    uint4* dst[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int m = base + u * kThreads;
      dst[u] = nullptr;
      if (m < total) {
        const int j = m % nv, t = m / nv;
        const int d = t % (N - 1) + 1, i = b + (t / (N - 1)) * G;
        const int q = (p.rank + d) % N;
        const int s = owned_start(p.tokens, N, q);
        if (i < owned_start(p.tokens, N, q + 1) - s) {
          v[u] = x[(size_t)(s + i) * nv + j];
          dst[u] = reinterpret_cast<uint4*>(slot_base(p, q, slot)) + ((size_t)p.rank * stride + i) * nv + j;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (dst[u]) *dst[u] = v[u];
  }
}

// AllGather by peer loads: block b copies rows i = b, b+G, ... of every peer's normed rows (plane 0) and, when
// gather_res, residual rows (plane 1) from the peer's output region into the caller's out / residual.
template <int N, int U>
__device__ __forceinline__ void pull_rows(const KParams& p, int slot, int stride, int nv, bool gather_res) {
  const int G = gridDim.x, b = blockIdx.x;
  const int rb = (stride - b + G - 1) / G;
  const int planes = gather_res ? 2 : 1;
  const int total = rb * (N - 1) * planes * nv;
  for (int base = threadIdx.x; base < total; base += U * kThreads) {
    uint4 v[U];
    uint4* dst[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int m = base + u * kThreads;
      dst[u] = nullptr;
      if (m < total) {
        const int j = m % nv, t = m / nv;
        const int plane = t % planes, t2 = t / planes;
        const int d = t2 % (N - 1) + 1, i = b + (t2 / (N - 1)) * G;
        const int q = (p.rank + d) % N;
        const int s = owned_start(p.tokens, N, q);
        if (i < owned_start(p.tokens, N, q + 1) - s) {
          const uint4* src = reinterpret_cast<const uint4*>(slot_base(p, q, slot) + p.region_bytes);
          v[u] = __ldcg(src + ((size_t)plane * stride + i) * nv + j);
          dst[u] = static_cast<uint4*>(plane ? p.residual : p.out) + (size_t)(s + i) * nv + j;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (dst[u]) *dst[u] = v[u];
  }
}

template <typename T, int N, int VPT, bool NORM, bool PUSH, bool PULL>
__global__ void __launch_bounds__(kThreads) twoshot_kernel(KParams p) {
  const uint32_t e = read_epoch(p.ctrl);
  const int slot = p.fixed_slot >= 0 ? p.fixed_slot : (int)(e & 1u);
  const int nv = p.hidden / 8;
  const int stride = (p.tokens + N - 1) / N;
  const uint4* x = static_cast<const uint4*>(p.x);
  if constexpr (PUSH) push_rows<N, kUnroll>(p, slot, stride, nv);
  block_barrier(p, 0, e);
  const int ms = owned_start(p.tokens, N, p.rank);
  const int mc = owned_start(p.tokens, N, p.rank + 1) - ms;
  const uint4* in_mine = reinterpret_cast<const uint4*>(slot_base(p, p.rank, slot));
  uint4* out_mine = reinterpret_cast<uint4*>(slot_base(p, p.rank, slot) + p.region_bytes);
  const bool gather_res = NORM && !p.residual_sharded;
  uint4 w[VPT];
  load_weight<VPT, NORM>(w, p.weight, nv);
  uint4* const res_base = static_cast<uint4*>(p.residual);
  const int r0 = (int)((long long)mc * p.chunk / p.nchunks);
  const int r1 = (int)((long long)mc * (p.chunk + 1) / p.nchunks);
  for (int i = r0 + blockIdx.x; i < r1; i += gridDim.x) {
    const size_t row = (size_t)(ms + i);
    float acc[VPT][8];
    uint4 rv[VPT];
    zero_acc(acc);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * kThreads;
      if (j < nv) {
        uint4 v[N];
        if (NORM) rv[k] = res_base[row * nv + j];
#pragma unroll
        for (int q = 0; q < N; ++q)
          v[q] = q == p.rank ? x[row * nv + j] : __ldcg(in_mine + ((size_t)q * stride + i) * nv + j);
#pragma unroll
        for (int q = 0; q < N; ++q) add_vec<T>(acc[k], v[q]);
      }
    }
    finish_row<T, VPT, NORM>(acc, nv, rv, w, p.weight, NORM ? res_base + row * nv : nullptr, p.eps,
                             static_cast<uint4*>(p.out) + row * nv, out_mine + (size_t)i * nv,
                             gather_res ? out_mine + ((size_t)stride + i) * nv : nullptr);
  }
  if constexpr (PULL) {
    block_barrier(p, 1, e);
    pull_rows<N, kUnroll>(p, slot, stride, nv, gather_res);
  }
  finish_epoch(p.ctrl, e);
}

template <typename T, int N, bool NORM, bool PUSH, bool PULL>
static void launch_vpt(const KParams& p, int grid, cudaStream_t s) {
  switch (vecs_per_thread(p.hidden)) {
    case 1: twoshot_kernel<T, N, 1, NORM, PUSH, PULL><<<grid, kThreads, 0, s>>>(p); break;
    case 2: twoshot_kernel<T, N, 2, NORM, PUSH, PULL><<<grid, kThreads, 0, s>>>(p); break;
    default: twoshot_kernel<T, N, 4, NORM, PUSH, PULL><<<grid, kThreads, 0, s>>>(p); break;
  }
}

template <typename T, bool NORM, bool PUSH, bool PULL>
static void launch_n(const KParams& p, int grid, cudaStream_t s) {
  switch (p.world) {
    case 2: launch_vpt<T, 2, NORM, PUSH, PULL>(p, grid, s); break;
    case 4: launch_vpt<T, 4, NORM, PUSH, PULL>(p, grid, s); break;
    default: launch_vpt<T, 8, NORM, PUSH, PULL>(p, grid, s); break;
  }
}

template <typename T>
static int launch_t(const KParams& p, bool norm, bool push, bool pull, int grid, cudaStream_t s) {
  if (norm && push && pull) launch_n<T, true, true, true>(p, grid, s);
  else if (!norm && push && pull) launch_n<T, false, true, true>(p, grid, s);
  else if (norm && !push && !pull) launch_n<T, true, false, false>(p, grid, s);
  else return set_error(TW_ERR_ARG, "unsupported two-shot phase combination");
  return TW_OK;
}

int launch_twoshot(tw_workspace* ws, KParams p, int dtype, bool norm, bool push, bool pull, int grid,
                   cudaStream_t stream) {
  (void)ws;
  const int rc = dtype == TW_BF16 ? launch_t<__nv_bfloat16>(p, norm, push, pull, grid, stream)
                                  : launch_t<__half>(p, norm, push, pull, grid, stream);
  if (rc) return rc;
  TW_CUDA_CHECK(cudaGetLastError());
  return TW_OK;
}

// Shared argument checks and parameter set-up of the two-shot family; returns the grid in *grid.
int prepare_twoshot(tw_workspace* ws, const void* x, void* residual, const void* weight, void* out, int tokens,
                    int hidden, int dtype, float eps, int max_blocks, int residual_sharded, bool norm, KParams* p,
                    int* grid) {
  if (!ws || !ws->opened) return set_error(TW_ERR_STATE, "workspace is not opened");
  int rc = check_common(tokens, hidden, dtype, max_blocks, x, residual, weight, out);
  if (rc) return rc;
  if (!x || !out || (norm && (!residual || !weight))) return set_error(TW_ERR_ARG, "null tensor pointer");
  const int n = ws->world;
  const int stride = (tokens + n - 1) / n;
  const size_t need = (size_t)n * stride * hidden * 2;
  if (need > ws->region_bytes)
    return set_error(TW_ERR_ARG, "two-shot needs %zu staging bytes > capacity %zu; create the workspace with a "
                     "larger max_bytes", need, ws->region_bytes);
  *p = make_params(ws);
  p->x = x;
  p->residual = residual;
  p->weight = weight;
  p->out = out;
  p->tokens = tokens;
  p->hidden = hidden;
  p->eps = eps;
  p->residual_sharded = residual_sharded ? 1 : 0;
  *grid = stride < max_blocks ? stride : max_blocks;
  return TW_OK;
}

}  // namespace twcomm

using namespace twcomm;

extern "C" {

int tw_twoshot_allreduce_rmsnorm(tw_workspace* ws, const void* x, void* residual, const void* weight, void* out,
                                 int tokens, int hidden, int dtype, float eps, int max_blocks,
                                 int residual_sharded, void* stream) {
  KParams p;
  int grid = 0;
  int rc = prepare_twoshot(ws, x, residual, weight, out, tokens, hidden, dtype, eps, max_blocks, residual_sharded,
                           true, &p, &grid);
  if (rc || tokens == 0) return rc;
  DeviceGuard guard(ws->device);
  return launch_twoshot(ws, p, dtype, true, true, true, grid, static_cast<cudaStream_t>(stream));
}

int tw_allreduce(tw_workspace* ws, const void* x, void* out, int tokens, int hidden, int dtype, int variant,
                 int max_blocks, void* stream) {
  if (variant == 0)
    return run_oneshot(ws, x, nullptr, nullptr, out, tokens, hidden, dtype, 0.f, max_blocks, false, stream);
  if (variant != 1) return set_error(TW_ERR_ARG, "variant=%d must be 0 (one-shot) or 1 (two-shot)", variant);
  KParams p;
  int grid = 0;
  int rc = prepare_twoshot(ws, x, nullptr, nullptr, out, tokens, hidden, dtype, 0.f, max_blocks, 1, false, &p,
                           &grid);
  if (rc || tokens == 0) return rc;
  DeviceGuard guard(ws->device);
  return launch_twoshot(ws, p, dtype, false, true, true, grid, static_cast<cudaStream_t>(stream));
}

}  // extern "C"
