// (b'') Bulk-copy P2P two-shot AllReduce + residual add + RMSNorm (TokenWeave, Gond et al. 2025, sections 3.3-4:
// the communication kernel runs on a bounded CTA count while the other token half computes).
//
// Same rows, staging layout, barriers and result as twoshot.cu (rank q owns token rows [q*T/N, (q+1)*T/N); block
// b of G handles the contiguous local row indices [b*S/G, (b+1)*S/G) of every rank's range, S = ceil(T/N)), but
// the two NVLink phases move data with Hopper's bulk asynchronous copies (cp.async.bulk, the 1-D TMA form) instead
// of per-thread 16-byte loads/stores:
//   push   x rows of every peer's range: global (local x) -> shared ring -> global (peer staging), bulk store
//   reduce own rows from local memory, residual add, RMSNorm (as twoshot.cu); where two row slots fit in shared
//          memory (world 2 up to H 16384, world 4 up to H 8192) the N contributions + residual of row j+1 arrive
//          by bulk loads while row j is summed from shared memory, else generic 16-byte loads
//   pull   every peer's normed (and, unless residual_sharded, residual) rows: global (peer output region) ->
//          shared ring -> global (caller's out / residual)
// Why: with 16 CTAs the per-thread copies of twoshot.cu are bound by bytes in flight per SM, not by instruction
// issue. NVLink at ~450 GB/s per direction with ~1.5-2 us load round trip needs ~0.7-0.9 MB in flight (Little's law);
// on 16 SMs that is ~45-56 KB per SM, all the time. One thread here keeps kBulkStages - 1 = 7 tiles of 16 KiB
// (112 KiB) of loads in flight per SM through the TMA unit, and the bulk stores leave shared memory as soon as
// they are read out, so 16 CTAs carry ~1.8 MB in flight: enough for line rate at up to ~4 us round trip.
//
// Pipeline of one thread (lane 0 of warp 0), tile g of a flat list over (peer, plane) segments, stage g % K:
//   load(g): mbarrier[stage].arrive.expect_tx(bytes); cp.async.bulk smem[stage] <- src (complete_tx on the barrier)
//   for g: wait mbarrier[stage] phase (g / K) & 1; bulk store smem[stage] -> dst; commit_group;
//          wait_group.read 1 (the store of tile g-1 has read stage (g-1) % K); load(g + K - 1) into that stage
//   end: wait_group 0 (every store performed), then fence.proxy.async + fence.acq_rel.sys before the flags.
// Ordering: the data a bulk load reads was released by the peer's flag (fence + relaxed store, acquired by
// ld.acquire.sys in block_barrier); fence.proxy.async.global after the barrier makes it visible to the async proxy.
#include "host_common.h"

namespace twcomm {

constexpr int kBulkStages = 8;               // shared-memory ring depth (tiles)
constexpr uint32_t kBulkTile = 16u * 1024u;  // bytes per tile (a multiple of 16; <= 2^20 - 1 for the tx count)
constexpr size_t kBulkRing = (size_t)kBulkStages * kBulkTile;
// The reduce prefetches whole rows (N - 1 staged rows, own x row, residual row) into two row slots of shared
// memory when 2 x (N + 1) x H x 2 bytes fit under this bound (world 2 up to H 16384, world 4 up to H 8192); else
// it loads with generic 16-byte loads.
constexpr size_t kRowSlotsMax = 200u * 1024u;
constexpr int kBulkBars = kBulkStages + 2;  // ring stages, then the two row slots

__host__ __device__ __forceinline__ size_t row_slots_bytes(int world, int hidden) {
  const size_t b = 2 * (size_t)(world + 1) * hidden * 2;
  return b <= kRowSlotsMax ? b : 0;
}

__host__ __device__ __forceinline__ size_t bulk_smem_bytes(int world, int hidden) {
  const size_t rows = row_slots_bytes(world, hidden);
  return (rows > kBulkRing ? rows : kBulkRing) + kBulkBars * sizeof(uint64_t);
}

// One contiguous copy: `bytes` (multiple of 16, 16-byte aligned ends) from src to dst.
struct BulkSeg {
  const char* src;
  char* dst;
  size_t bytes;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// Bulk load global -> shared, completing `bytes` of transaction count on `bar` (armed here by this thread).
__device__ __forceinline__ void bulk_load(void* smem, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(smem)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// Bulk store shared -> global (any mapped global address, peers' included), one bulk async-group per call.
__device__ __forceinline__ void bulk_store(void* dst, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(smem)),
               "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Tile t of the flat tile list over segs[0..nseg): source, destination, bytes.
__device__ __forceinline__ uint32_t seg_tile(const BulkSeg* segs, int nseg, int t, const char** src, char** dst) {
  for (int k = 0; k < nseg; ++k) {
    const int nt = (int)((segs[k].bytes + kBulkTile - 1) / kBulkTile);
    if (t < nt) {
      const size_t off = (size_t)t * kBulkTile;
      *src = segs[k].src + off;
      *dst = segs[k].dst + off;
      const size_t left = segs[k].bytes - off;
      return left < kBulkTile ? (uint32_t)left : kBulkTile;
    }
    t -= nt;
  }
  return 0;
}

// Single-thread pipelined copy of every segment through the shared ring. `g0`: tiles this kernel already moved
// through the ring (phase bookkeeping); returns the new count. Ends with every store performed and visible to
// the system-scope fence that follows.
__device__ uint32_t bulk_copy(const BulkSeg* segs, int nseg, char* ring, uint64_t* bars, uint32_t g0) {
  int n = 0;
  for (int k = 0; k < nseg; ++k) n += (int)((segs[k].bytes + kBulkTile - 1) / kBulkTile);
  const char* src;
  char* dst;
  for (int t = 0; t < n && t < kBulkStages - 1; ++t) {
    const uint32_t s = (g0 + t) % kBulkStages;
    const uint32_t b = seg_tile(segs, nseg, t, &src, &dst);
    bulk_load(ring + (size_t)s * kBulkTile, src, b, bars + s);
  }
  for (int t = 0; t < n; ++t) {
    const uint32_t g = g0 + t, s = g % kBulkStages;
    mbar_wait(bars + s, (g / kBulkStages) & 1u);
    const uint32_t b = seg_tile(segs, nseg, t, &src, &dst);
    bulk_store(dst, ring + (size_t)s * kBulkTile, b);
    const int nxt = t + kBulkStages - 1;
    if (nxt < n) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");  // store t-1 has read stage (g-1) % K
      const uint32_t s2 = (g0 + nxt) % kBulkStages;
      const uint32_t b2 = seg_tile(segs, nseg, nxt, &src, &dst);
      bulk_load(ring + (size_t)s2 * kBulkTile, src, b2, bars + s2);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  fence_sys();
  return g0 + (uint32_t)n;
}

// Issue the bulk loads of local row i (N contributions in rank order: peers' staged rows, own x at q == rank; then
// the residual row) into row slot `dst`, completing on `bar`. One thread.
template <int N>
__device__ __forceinline__ void prefetch_row(const KParams& p, int slot, int stride, int i, char* dst,
                                             uint64_t* bar) {
  const uint32_t rb = (uint32_t)p.hidden * 2;
  const size_t row = (size_t)(owned_start(p.tokens, N, p.rank) + i);
  const char* in_mine = slot_base(p, p.rank, slot);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(rb * (N + 1))
               : "memory");
  for (int q = 0; q < N; ++q) {
    const char* src = q == p.rank ? static_cast<const char*>(p.x) + row * rb : in_mine + ((size_t)q * stride + i) * rb;
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_u32(dst + (size_t)q * rb)),
        "l"(src), "r"(rb), "r"(smem_u32(bar))
        : "memory");
  }
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(dst + (size_t)N * rb)),
      "l"(static_cast<const char*>(p.residual) + row * rb), "r"(rb), "r"(smem_u32(bar))
      : "memory");
}

// Reduce own local rows [r0, r1) with the inputs of row j + 1 in flight (bulk loads into the other row slot)
// while row j is summed from shared memory: the local HBM latency is paid once per block, not once per row.
// Same arithmetic and outputs as bulk_reduce.
template <typename T, int N, int VPT>
__device__ __forceinline__ void bulk_reduce_prefetch(const KParams& p, int slot, int stride, int nv, int r0, int r1,
                                                     const uint4 (&w)[VPT], char* smem, uint64_t* rbars) {
  const size_t rslot = (size_t)(N + 1) * nv;  // uint4 per row slot
  const int ms = owned_start(p.tokens, N, p.rank);
  uint4* out_mine = reinterpret_cast<uint4*>(slot_base(p, p.rank, slot) + p.region_bytes);
  uint4* const res_base = static_cast<uint4*>(p.residual);
  const uint4* sm = reinterpret_cast<const uint4*>(smem);
  if (threadIdx.x == 0) {
    asm volatile("fence.proxy.async.global;" ::: "memory");  // peers' bulk stores, acquired by the barrier
    for (int k = 0; k < 2 && r0 + k < r1; ++k)
      prefetch_row<N>(p, slot, stride, r0 + k, smem + k * rslot * 16, rbars + k);
  }
  for (int i = r0; i < r1; ++i) {
    const int j = i - r0, b = j & 1;
    mbar_wait(rbars + b, (uint32_t)(j >> 1) & 1u);
    const uint4* rowp = sm + b * rslot;
    const size_t row = (size_t)(ms + i);
    float acc[VPT][8];
    uint4 rv[VPT];
    zero_acc(acc);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int jj = threadIdx.x + k * kThreads;
      if (jj < nv) {
        rv[k] = rowp[(size_t)N * nv + jj];
#pragma unroll
        for (int q = 0; q < N; ++q) add_vec<T>(acc[k], rowp[(size_t)q * nv + jj]);
      }
    }
    // finish_row's block_sum holds a __syncthreads() after every thread's shared reads of this slot
    finish_row<T, VPT, true>(acc, nv, rv, w, p.weight, res_base + row * nv, p.eps,
                             static_cast<uint4*>(p.out) + row * nv, out_mine + (size_t)i * nv,
                             p.residual_sharded ? nullptr : out_mine + ((size_t)stride + i) * nv);
    if (threadIdx.x == 0 && i + 2 < r1) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic reads of the slot before its refill
      prefetch_row<N>(p, slot, stride, i + 2, smem + b * rslot * 16, rbars + b);
    }
  }
}

// Reduce own local rows [r0, r1): peers' staged rows + own x in rank order, residual add, RMSNorm; writes the
// caller's residual / out rows and the normed (and residual) copies peers pull. As twoshot.cu's reduce loop.
template <typename T, int N, int VPT>
__device__ __forceinline__ void bulk_reduce(const KParams& p, int slot, int stride, int nv, int r0, int r1,
                                            const uint4 (&w)[VPT]) {
  const int ms = owned_start(p.tokens, N, p.rank);
  const uint4* x = static_cast<const uint4*>(p.x);
  const uint4* in_mine = reinterpret_cast<const uint4*>(slot_base(p, p.rank, slot));
  uint4* out_mine = reinterpret_cast<uint4*>(slot_base(p, p.rank, slot) + p.region_bytes);
  uint4* const res_base = static_cast<uint4*>(p.residual);
  for (int i = r0; i < r1; ++i) {
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

// Segments of this block's push (planes == 0) or pull (planes 1 or 2) over the N - 1 peers; returns the count.
template <int N>
__device__ __forceinline__ int bulk_segs(const KParams& p, int slot, int stride, int lo, int hi, int planes,
                                         BulkSeg (&segs)[2 * (N - 1)]) {
  const size_t rb = (size_t)p.hidden * 2;
  int n = 0;
  for (int d = 1; d < N; ++d) {
    const int q = (p.rank + d) % N;
    const int s = owned_start(p.tokens, N, q);
    const int e = min(hi, owned_start(p.tokens, N, q + 1) - s);
    if (e <= lo) continue;
    const size_t nbytes = (size_t)(e - lo) * rb;
    const char* outq = slot_base(p, q, slot) + p.region_bytes;
    BulkSeg& a = segs[n++];
    a.bytes = nbytes;
    if (planes == 0) {
      a.src = static_cast<const char*>(p.x) + (s + lo) * rb;
      a.dst = slot_base(p, q, slot) + ((size_t)p.rank * stride + lo) * rb;
      continue;
    }
    a.src = outq + lo * rb;
    a.dst = static_cast<char*>(p.out) + (s + lo) * rb;
    if (planes == 2) {
      BulkSeg& r = segs[n++];
      r.bytes = nbytes;
      r.src = outq + ((size_t)stride + lo) * rb;
      r.dst = static_cast<char*>(p.residual) + (s + lo) * rb;
    }
  }
  return n;
}

template <typename T, int N, int VPT>
__global__ void __launch_bounds__(kThreads, 1) twoshot_bulk_kernel(KParams p) {
  extern __shared__ __align__(128) char bulk_smem[];
  const size_t rows_bytes = row_slots_bytes(N, p.hidden);
  uint64_t* bars = reinterpret_cast<uint64_t*>(bulk_smem + (rows_bytes > kBulkRing ? rows_bytes : kBulkRing));
  const uint32_t e = read_epoch(p.ctrl);
  const int slot = (int)(e & 1u);
  const int nv = p.hidden / 8;
  const int stride = (p.tokens + N - 1) / N;
  const int lo = (int)((long long)stride * blockIdx.x / gridDim.x);
  const int hi = (int)((long long)stride * (blockIdx.x + 1) / gridDim.x);
  const bool leader = threadIdx.x == 0;
  uint32_t g = 0;
  if (leader) {
    for (int s = 0; s < kBulkBars; ++s) mbar_init(bars + s);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    BulkSeg segs[2 * (N - 1)];
    const int n = bulk_segs<N>(p, slot, stride, lo, hi, 0, segs);
    g = bulk_copy(segs, n, bulk_smem, bars, g);
  }
  block_barrier(p, 0, e);
  uint4 w[VPT];
  load_weight<VPT, true>(w, p.weight, nv);
  const int mc = owned_start(p.tokens, N, p.rank + 1) - owned_start(p.tokens, N, p.rank);
  if (rows_bytes)
    bulk_reduce_prefetch<T, N, VPT>(p, slot, stride, nv, lo, min(hi, mc), w, bulk_smem, bars + kBulkStages);
  else
    bulk_reduce<T, N, VPT>(p, slot, stride, nv, lo, min(hi, mc), w);
  block_barrier(p, 1, e);
  if (leader) {
    asm volatile("fence.proxy.async;" ::: "memory");  // peers' generic stores, our generic smem reads -> bulk
    BulkSeg segs[2 * (N - 1)];
    const int n = bulk_segs<N>(p, slot, stride, lo, hi, p.residual_sharded ? 1 : 2, segs);
    g = bulk_copy(segs, n, bulk_smem, bars, g);
  }
  finish_epoch(p.ctrl, e);
}

template <typename T, int N, int VPT>
static cudaError_t launch_bulk_one(const KParams& p, int grid, cudaStream_t s) {
  // Raising the dynamic shared-memory limit is per function and cheap; doing it on every launch keeps the code
  // free of global "initialized" state (and is legal during CUDA-graph capture).
  const size_t smem = bulk_smem_bytes(N, p.hidden);
  cudaError_t err = cudaFuncSetAttribute(twoshot_bulk_kernel<T, N, VPT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  twoshot_bulk_kernel<T, N, VPT><<<grid, kThreads, smem, s>>>(p);
  return cudaGetLastError();
}

template <typename T, int N>
static cudaError_t launch_bulk_vpt(const KParams& p, int grid, cudaStream_t s) {
  switch (vecs_per_thread(p.hidden)) {
    case 1: return launch_bulk_one<T, N, 1>(p, grid, s);
    case 2: return launch_bulk_one<T, N, 2>(p, grid, s);
    default: return launch_bulk_one<T, N, 4>(p, grid, s);
  }
}

template <typename T>
static cudaError_t launch_bulk_n(const KParams& p, int grid, cudaStream_t s) {
  switch (p.world) {
    case 2: return launch_bulk_vpt<T, 2>(p, grid, s);
    case 4: return launch_bulk_vpt<T, 4>(p, grid, s);
    default: return launch_bulk_vpt<T, 8>(p, grid, s);
  }
}

}  // namespace twcomm

using namespace twcomm;

extern "C" {

int tw_twoshot_bulk_allreduce_rmsnorm(tw_workspace* ws, const void* x, void* residual, const void* weight,
                                      void* out, int tokens, int hidden, int dtype, float eps, int max_blocks,
                                      int residual_sharded, void* stream) {
  KParams p;
  int grid = 0;
  int rc = prepare_twoshot(ws, x, residual, weight, out, tokens, hidden, dtype, eps, max_blocks, residual_sharded,
                           true, &p, &grid);
  if (rc || tokens == 0) return rc;
  DeviceGuard guard(ws->device);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  TW_CUDA_CHECK(dtype == TW_BF16 ? launch_bulk_n<__nv_bfloat16>(p, grid, s) : launch_bulk_n<__half>(p, grid, s));
  return TW_OK;
}

}  // extern "C"
