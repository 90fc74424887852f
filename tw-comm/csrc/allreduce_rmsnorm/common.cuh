// Device-side helpers shared by the tw-comm allreduce(+rmsnorm) kernels.
//
// Synchronisation scheme (no resets, CUDA-graph safe):
//  * every rank keeps a local epoch counter (ctrl[0], starts at 1). Each kernel reads it at entry and the last
//    block to finish (arrival counter ctrl[1]) bumps it. All ranks launch the same kernel sequence with the same
//    grids, so their epochs agree call by call.
//  * the signal pad of every rank holds flags[barrier][block][src_rank]. Block b on rank r arrives at a barrier
//    by writing the epoch into flags[barrier][b][r] on every peer (system fence + st.relaxed.sys) and waits until
//    its own flags[barrier][b][q] >= epoch for all q (ld.acquire.sys). Flags only grow, so they are reused across any
//    number of calls; a peer can be at most one kernel ahead, which a ">=" test tolerates.
//  * staging buffers have two slots picked by epoch parity, so a fast peer's next call never overwrites data a
//    slow rank still reads: one barrier per data hand-off suffices.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "tw_comm/tw_comm.h"

namespace twcomm {

constexpr int kThreads = 512;       // threads per block of the data kernels
constexpr int kNumBarriers = 4;     // barrier ids: 0 = data pushed, 1 = rows normed, 2 = standalone barrier
constexpr size_t kPadBytes = 64 * 1024;
constexpr size_t kLamportRankBytes = 2u << 20;  // Lamport one-shot: payload bytes per source rank and buffer
constexpr int kLamportBuffers = 3;              // buffer = epoch % 3 (see lamport.cu)
constexpr uint32_t kLamportEmpty = 0x80008000u;  // two 16-bit negative zeros: "no data yet" (bf16 and fp16)
static_assert(sizeof(uint32_t) * kNumBarriers * TW_MAX_BLOCKS * TW_MAX_RANKS <= kPadBytes, "pad too small");
// Pipelined two-shot (twoshot_pipe.cu): 64-bit flags [kind][block][src] after the 32-bit ones; value
// (epoch << 32) | (chunk + 1), so a flag left stale by any number of calls of other kernels never reads as ahead.
constexpr size_t kPipeFlagOff = sizeof(uint32_t) * kNumBarriers * TW_MAX_BLOCKS * TW_MAX_RANKS;
constexpr int kPipeFlagKinds = 2;  // 0 = chunk pushed (to its owner), 1 = chunk normed (by its owner)
static_assert(kPipeFlagOff + sizeof(uint64_t) * kPipeFlagKinds * TW_MAX_BLOCKS * TW_MAX_RANKS <= kPadBytes,
              "pad too small for the pipelined two-shot flags");

// Everything a kernel needs; passed by value so CUDA-graph replays reuse it unchanged.
struct KParams {
  char* peer_base[TW_MAX_RANKS];  // each rank's allocation, mapped into this process (own included)
  uint32_t* ctrl;                 // local: [0] epoch, [1] arrivals
  int rank;
  int world;
  size_t slot_bytes;              // one slot = input region + output region
  size_t region_bytes;
  int fixed_slot;                 // -1: slot = epoch parity
  const void* x;
  void* residual;
  const void* weight;
  void* out;
  int tokens;
  int hidden;
  float eps;
  int residual_sharded;
  int chunk;    // reduce only chunk `chunk` of `nchunks` of this rank's token range (copy-engine pipelining)
  int nchunks;  // 1 = the whole range
  size_t lamport_off;    // offset of the Lamport region (3 buffers) in every rank's allocation
  size_t lamport_bytes;  // bytes of one Lamport buffer (world x tokens x hidden x 2 at most)
};

__device__ __forceinline__ uint32_t* flag_ptr(char* base, int barrier, int block, int src) {
  return reinterpret_cast<uint32_t*>(base) + ((size_t)barrier * TW_MAX_BLOCKS + block) * TW_MAX_RANKS + src;
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Slot base (input region) of rank q's staging buffers.
__device__ __forceinline__ char* slot_base(const KParams& p, int q, int slot) {
  return p.peer_base[q] + kPadBytes + (size_t)slot * p.slot_bytes;
}

__device__ __forceinline__ uint32_t read_epoch(const uint32_t* ctrl) {
  __shared__ uint32_t s_epoch;
  if (threadIdx.x == 0) s_epoch = *reinterpret_cast<const volatile uint32_t*>(ctrl);
  __syncthreads();
  return s_epoch;
}

// Last block out bumps the epoch; every block read it at entry, before arriving here.
__device__ __forceinline__ void finish_epoch(uint32_t* ctrl, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    uint32_t old = atomicAdd(ctrl + 1, 1u);
    if (old == gridDim.x - 1) {
      ctrl[1] = 0;
      __threadfence();
      *reinterpret_cast<volatile uint32_t*>(ctrl) = epoch + 1;
    }
  }
}

// Cross-rank barrier of block blockIdx.x with the same block index on every rank. __syncthreads() orders every
// thread's (possibly remote) stores before the signalling threads' system-scope fence (PTX fences are cumulative
// over what bar.sync made visible to the fencing thread), so one fence -- a single warp instruction of the
// signalling lanes 0..world-1, not one per thread of the block -- followed by relaxed flag stores (fence + strong
// store = a release pattern) makes the flags cover all data the block wrote. (st.release after the fence would
// add a second system fence per barrier.)
__device__ __forceinline__ void block_barrier(const KParams& p, int barrier, uint32_t epoch) {
  __syncthreads();
  const int t = threadIdx.x;
  if (t < p.world) {
    fence_sys();
    st_relaxed_sys(flag_ptr(p.peer_base[t], barrier, blockIdx.x, p.rank), epoch);
    const uint32_t* mine = flag_ptr(p.peer_base[p.rank], barrier, blockIdx.x, t);
    while ((int)(ld_acquire_sys(mine) - epoch) < 0) {
    }
  }
  __syncthreads();
}

template <typename T>
struct Pack;
template <>
struct Pack<__nv_bfloat16> {
  __device__ static __forceinline__ void unpack(const uint4& v, float f[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 g = __bfloat1622float2(h[i]);
      f[2 * i] = g.x;
      f[2 * i + 1] = g.y;
    }
  }
  __device__ static __forceinline__ uint4 pack(const float f[8]) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
};
template <>
struct Pack<__half> {
  __device__ static __forceinline__ void unpack(const uint4& v, float f[8]) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 g = __half22float2(h[i]);
      f[2 * i] = g.x;
      f[2 * i + 1] = g.y;
    }
  }
  __device__ static __forceinline__ uint4 pack(const float f[8]) {
    uint4 v;
    __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
};

template <typename T>
__device__ __forceinline__ void add_vec(float f[8], const uint4& v) {
  float g[8];
  Pack<T>::unpack(v, g);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] += g[i];
}

// Sum over the block; every thread gets the result. Safe to call repeatedly (trailing barrier).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float s_part[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) s_part[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) total += s_part[i];
  __syncthreads();
  return total;
}

template <int VPT>
constexpr bool kWeightInRegs = VPT <= 2;

// Given acc = sum over ranks of one row (fp32, this thread's VPT vectors), the row's residual vectors `res_in`
// and weight vectors `w` (loaded by the caller together with the contributions, so one memory latency covers
// them all), apply s = acc + residual; residual = s; out = s * rsqrt(mean(s^2)+eps) * weight (NORM), or
// out = acc (!NORM). Writes out_row and, when extra_out/extra_res are non-null, copies of out / residual there.
template <typename T, int VPT, bool NORM>
__device__ __forceinline__ void finish_row(float (&acc)[VPT][8], int nv, const uint4 (&res_in)[VPT],
                                           const uint4 (&w)[VPT], const void* weight, uint4* residual_row,
                                           float eps, uint4* out_row, uint4* extra_out, uint4* extra_res) {
  if constexpr (NORM) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * kThreads;
      if (j < nv) {
        add_vec<T>(acc[k], res_in[k]);
        const uint4 r = Pack<T>::pack(acc[k]);
        residual_row[j] = r;
        if (extra_res) extra_res[j] = r;
#pragma unroll
        for (int i = 0; i < 8; ++i) ss += acc[k][i] * acc[k][i];
      }
    }
    const float rstd = rsqrtf(block_sum(ss) / (float)(nv * 8) + eps);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * kThreads;
      if (j < nv) {
        float wf[8];
        Pack<T>::unpack(kWeightInRegs<VPT> ? w[k] : static_cast<const uint4*>(weight)[j], wf);
        float y[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = acc[k][i] * rstd * wf[i];
        const uint4 o = Pack<T>::pack(y);
        out_row[j] = o;
        if (extra_out) extra_out[j] = o;
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * kThreads;
      if (j < nv) {
        const uint4 o = Pack<T>::pack(acc[k]);
        out_row[j] = o;
        if (extra_out) extra_out[j] = o;
      }
    }
  }
}

// Load this thread's VPT weight vectors once per block (NORM only; for VPT == 4 the weight is re-read per row
// instead, which keeps those kernels free of register spills).
template <int VPT, bool NORM>
__device__ __forceinline__ void load_weight(uint4 (&w)[VPT], const void* weight, int nv) {
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int j = threadIdx.x + k * kThreads;
    w[k] = make_uint4(0, 0, 0, 0);
    if (NORM && kWeightInRegs<VPT> && j < nv) w[k] = static_cast<const uint4*>(weight)[j];
  }
}

template <int VPT>
__device__ __forceinline__ void zero_acc(float (&acc)[VPT][8]) {
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[k][i] = 0.f;
}

// Token range [start, start+count) owned by rank q in the two-shot split: balanced, any T.
__device__ __host__ __forceinline__ int owned_start(int tokens, int world, int q) {
  return (int)(((long long)tokens * q) / world);
}

}  // namespace twcomm
