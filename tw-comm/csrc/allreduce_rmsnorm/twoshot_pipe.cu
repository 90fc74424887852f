// (b') Pipelined P2P two-shot AllReduce + residual add + RMSNorm (TokenWeave, Gond et al. 2025, section 3.3):
// the two-shot of twoshot.cu with per-chunk flags, so NVLink never waits for a whole phase to end.
//
// Rows split as in twoshot.cu (rank q owns token rows [q*T/N, (q+1)*T/N)); block b of G handles the contiguous
// local row indices [b*S/G, (b+1)*S/G) of every rank's range (S = ceil(T/N)), cut into chunks of `chunk_rows`
// rows. Per chunk c, software-pipelined inside each block:
//   push(c+1)       stores of the caller's x rows of chunk c+1 into each owner's staging (posted, not waited on)
//   pull(c-1)       once every owner flagged chunk c-1 normed: 16-byte loads of its normed (and, unless
//                   residual_sharded, residual) rows straight into the caller's out / residual
//   reduce(c)       once every peer flagged chunk c pushed: local sum in fixed rank order, residual add, RMSNorm
//   signal          __syncthreads(); one system-scope fence (one warp instruction of the signalling lanes)
//                   covering the block's stores, then relaxed stores of "chunk c+1 pushed" / "chunk c normed"
// so the pushes of one chunk, the pulls of another and the local reduce of a third overlap, and the link never
// idles for a whole-tensor barrier. Each thread keeps kPipeUnroll 16-byte transfers in flight in the copies.
// Flags: 64-bit (epoch << 32 | chunk + 1) per (kind, block, source rank), only growing (see common.cuh); data
// slots alternate by epoch parity as in twoshot.cu, so a peer one call ahead never overwrites live data.
#include "host_common.h"

namespace twcomm {

constexpr int kPipeUnroll = 8;  // independent 16-byte transfers in flight per thread in push / pull

__device__ __forceinline__ uint64_t* pipe_flag(char* base, int kind, int block, int src) {
  return reinterpret_cast<uint64_t*>(base + kPipeFlagOff) + ((size_t)kind * TW_MAX_BLOCKS + block) * TW_MAX_RANKS +
         src;
}

__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// m = q * nv + r for 0 <= m < 2^24 (float reciprocal, then an exact +-1 fix-up): no integer division per vector.
__device__ __forceinline__ void divmod_nv(int m, int nv, float inv_nv, int& q, int& r) {
  q = __float2int_rz((float)m * inv_nv);
  r = m - q * nv;
  if (r < 0) {
    --q;
    r += nv;
  } else if (r >= nv) {
    ++q;
    r -= nv;
  }
}

// Block-wide: after __syncthreads(), the lanes t < world, t != rank of warp 0 each fence once (one warp-level
// fence) and publish flag `kind` = value on rank t; a second (kind2, value2) rides on the same fence if value2.
__device__ __forceinline__ void pipe_signal(const KParams& p, int kind, uint64_t value, int kind2, uint64_t value2) {
  __syncthreads();
  const int t = threadIdx.x;
  if (t < p.world && t != p.rank) {
    fence_sys();
    st_relaxed_sys_u64(pipe_flag(p.peer_base[t], kind, blockIdx.x, p.rank), value);
    if (value2) st_relaxed_sys_u64(pipe_flag(p.peer_base[t], kind2, blockIdx.x, p.rank), value2);
  }
}

// Block-wide: wait until every peer's flag `kind` for this block reached `value` (acquire), then __syncthreads().
__device__ __forceinline__ void pipe_wait(const KParams& p, int kind, uint64_t value) {
  const int t = threadIdx.x;
  if (t < p.world && t != p.rank) {
    const uint64_t* f = pipe_flag(p.peer_base[p.rank], kind, blockIdx.x, t);
    while ((long long)(ld_acquire_sys_u64(f) - value) < 0) {
    }
  }
  __syncthreads();
}

// Push local rows [r0, r1) of every peer q's token range from the caller's x to q's staging [src = rank][i].
template <int N, int U>
__device__ __forceinline__ void pipe_push(const KParams& p, int slot, int stride, int nv, float inv_nv, int r0,
                                          int r1) {
  const uint4* x = static_cast<const uint4*>(p.x);
  const int total = (N - 1) * (r1 - r0) * nv;
  for (int base = threadIdx.x; base < total; base += U * kThreads) {
    uint4 v[U];
    uint4* dst[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int m = base + u * kThreads;
      dst[u] = nullptr;
      if (m < total) {
        int unit, j;
        divmod_nv(m, nv, inv_nv, unit, j);
        const int q = (p.rank + unit % (N - 1) + 1) % N, i = r0 + unit / (N - 1);
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

// Pull local rows [r0, r1) of every peer q's range: normed rows (plane 0) and, when planes == 2, residual rows
// (plane 1) from q's output region into the caller's out / residual.
template <int N, int U>
__device__ __forceinline__ void pipe_pull(const KParams& p, int slot, int stride, int nv, float inv_nv, int r0,
                                          int r1, int planes) {
  const int total = (N - 1) * planes * (r1 - r0) * nv;
  for (int base = threadIdx.x; base < total; base += U * kThreads) {
    uint4 v[U];
    uint4* dst[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int m = base + u * kThreads;
      dst[u] = nullptr;
      if (m < total) {
        int unit, j;
        divmod_nv(m, nv, inv_nv, unit, j);
        const int plane = unit & (planes - 1), t = unit >> (planes - 1);  // planes is 1 or 2
        const int q = (p.rank + t % (N - 1) + 1) % N, i = r0 + t / (N - 1);
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

// Reduce own rows [r0, min(r1, own count)): sum of the peers' staged rows and own x in rank order, residual add,
// RMSNorm; writes the caller's residual / out rows and the normed (and residual) copies peers pull.
template <typename T, int N, int VPT>
__device__ __forceinline__ void pipe_reduce(const KParams& p, int slot, int stride, int nv, int r0, int r1,
                                            const uint4 (&w)[VPT]) {
  const int ms = owned_start(p.tokens, N, p.rank);
  const int mc = owned_start(p.tokens, N, p.rank + 1) - ms;
  const uint4* x = static_cast<const uint4*>(p.x);
  const uint4* in_mine = reinterpret_cast<const uint4*>(slot_base(p, p.rank, slot));
  uint4* out_mine = reinterpret_cast<uint4*>(slot_base(p, p.rank, slot) + p.region_bytes);
  uint4* const res_base = static_cast<uint4*>(p.residual);
  const int end = r1 < mc ? r1 : mc;
  for (int i = r0; i < end; ++i) {
    const size_t row = (size_t)(ms + i);
    float acc[VPT][8];
    uint4 rv[VPT];
    zero_acc(acc);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * kThreads;
      if (j < nv) {
        uint4 v[N];
        rv[k] = res_base[row * nv + j];
#pragma unroll
        for (int q = 0; q < N; ++q)
          v[q] = q == p.rank ? x[row * nv + j] : __ldcg(in_mine + ((size_t)q * stride + i) * nv + j);
#pragma unroll
        for (int q = 0; q < N; ++q) add_vec<T>(acc[k], v[q]);
      }
    }
    finish_row<T, VPT, true>(acc, nv, rv, w, p.weight, res_base + row * nv, p.eps,
                             static_cast<uint4*>(p.out) + row * nv, out_mine + (size_t)i * nv,
                             p.residual_sharded ? nullptr : out_mine + ((size_t)stride + i) * nv);
  }
}

template <typename T, int N, int VPT>
__global__ void __launch_bounds__(kThreads) twoshot_pipe_kernel(KParams p, int chunk_rows, float inv_nv) {
  const uint32_t e = read_epoch(p.ctrl);
  const int slot = (int)(e & 1u);
  const int nv = p.hidden / 8;
  const int stride = (p.tokens + N - 1) / N;
  const int lo = (int)((long long)stride * blockIdx.x / gridDim.x);
  const int hi = (int)((long long)stride * (blockIdx.x + 1) / gridDim.x);
  const int nchunks = (hi - lo + chunk_rows - 1) / chunk_rows;
  const int planes = p.residual_sharded ? 1 : 2;
  const uint64_t tag = (uint64_t)e << 32;  // flag value of chunk c: tag + c + 1
  auto c0 = [&](int c) { return lo + c * chunk_rows; };
  auto c1 = [&](int c) { return min(hi, lo + (c + 1) * chunk_rows); };
  uint4 w[VPT];
  load_weight<VPT, true>(w, p.weight, nv);
  if (nchunks > 0) {
    pipe_push<N, kPipeUnroll>(p, slot, stride, nv, inv_nv, c0(0), c1(0));
    pipe_signal(p, 0, tag + 1, 0, 0);
  }
  for (int c = 0; c < nchunks; ++c) {
    const bool more = c + 1 < nchunks;
    if (more) pipe_push<N, kPipeUnroll>(p, slot, stride, nv, inv_nv, c0(c + 1), c1(c + 1));
    if (c > 0) {
      pipe_wait(p, 1, tag + c);
      pipe_pull<N, kPipeUnroll>(p, slot, stride, nv, inv_nv, c0(c - 1), c1(c - 1), planes);
    }
    pipe_wait(p, 0, tag + c + 1);
    pipe_reduce<T, N, VPT>(p, slot, stride, nv, c0(c), c1(c), w);
    pipe_signal(p, 1, tag + c + 1, 0, more ? tag + c + 2 : 0);
  }
  if (nchunks > 0) {
    pipe_wait(p, 1, tag + nchunks);
    pipe_pull<N, kPipeUnroll>(p, slot, stride, nv, inv_nv, c0(nchunks - 1), c1(nchunks - 1), planes);
  }
  finish_epoch(p.ctrl, e);
}

template <typename T, int N>
static void launch_pipe_vpt(const KParams& p, int grid, int chunk_rows, float inv_nv, cudaStream_t s) {
  switch (vecs_per_thread(p.hidden)) {
    case 1: twoshot_pipe_kernel<T, N, 1><<<grid, kThreads, 0, s>>>(p, chunk_rows, inv_nv); break;
    case 2: twoshot_pipe_kernel<T, N, 2><<<grid, kThreads, 0, s>>>(p, chunk_rows, inv_nv); break;
    default: twoshot_pipe_kernel<T, N, 4><<<grid, kThreads, 0, s>>>(p, chunk_rows, inv_nv); break;
  }
}

template <typename T>
static void launch_pipe_n(const KParams& p, int grid, int chunk_rows, float inv_nv, cudaStream_t s) {
  switch (p.world) {
    case 2: launch_pipe_vpt<T, 2>(p, grid, chunk_rows, inv_nv, s); break;
    case 4: launch_pipe_vpt<T, 4>(p, grid, chunk_rows, inv_nv, s); break;
    default: launch_pipe_vpt<T, 8>(p, grid, chunk_rows, inv_nv, s); break;
  }
}

// Rows per chunk: about chunk_bytes of one peer's rows (at least one row).
static int pipe_chunk_rows(int hidden, int chunk_bytes) {
  const int rows = chunk_bytes / (hidden * 2);
  return rows < 1 ? 1 : rows;
}

}  // namespace twcomm

using namespace twcomm;

extern "C" {

int tw_twoshot_pipe_allreduce_rmsnorm(tw_workspace* ws, const void* x, void* residual, const void* weight,
                                      void* out, int tokens, int hidden, int dtype, float eps, int max_blocks,
                                      int residual_sharded, int chunk_bytes, void* stream) {
  if (chunk_bytes < 0) return set_error(TW_ERR_ARG, "chunk_bytes=%d must be >= 0 (0: default)", chunk_bytes);
  KParams p;
  int grid = 0;
  int rc = prepare_twoshot(ws, x, residual, weight, out, tokens, hidden, dtype, eps, max_blocks, residual_sharded,
                           true, &p, &grid);
  if (rc || tokens == 0) return rc;
  const int chunk_rows = pipe_chunk_rows(hidden, chunk_bytes ? chunk_bytes : TW_PIPE_CHUNK_BYTES);
  // divmod_nv needs every flattened index of one chunk's copy, (world-1) x 2 planes x rows x vectors, < 2^24
  const long long max_m = 2LL * (ws->world - 1) * chunk_rows * (hidden / 8);
  if (max_m >= (1LL << 24))
    return set_error(TW_ERR_ARG, "chunk_bytes=%d too large for hidden=%d (a chunk must stay under 2^24 vectors)",
                     chunk_bytes, hidden);
  DeviceGuard guard(ws->device);
  const float inv_nv = 1.0f / (float)(hidden / 8);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == TW_BF16) launch_pipe_n<__nv_bfloat16>(p, grid, chunk_rows, inv_nv, s);
  else launch_pipe_n<__half>(p, grid, chunk_rows, inv_nv, s);
  TW_CUDA_CHECK(cudaGetLastError());
  return TW_OK;
}

}  // extern "C"
