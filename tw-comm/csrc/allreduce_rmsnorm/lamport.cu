// (a') Lamport one-shot AllReduce + residual add + RMSNorm for small token counts: the flag is in the data.
//
// Each rank stores its rows, with every negative zero turned into +0, into buffer b = epoch % 3 of every rank's
// Lamport region at [src = this rank][row]. Empty slots hold the negative-zero pattern (0x8000 in each 16-bit
// lane), which canonicalized data never contains, so a reader spins on its own local copy until no lane of a
// 16-byte vector is the sentinel: no barrier, no flag write, one NVLink crossing. The reader then reduces in the
// fixed rank order 0..N-1 (bit-identical on every rank), adds the residual, applies RMSNorm, and writes the
// sentinel back into every slot it consumed. Reuse is safe without a reset barrier: a peer writes buffer b again
// only at epoch + 3, which needs this rank's data of epoch + 1 and + 2, issued after this kernel ended (same
// stream); three buffers keep a peer that runs one call ahead off the buffer being read and cleared.
// Technique: the flag-in-data one-shot of TensorRT-LLM's / vLLM's custom all-reduce (Lamport clocks in the data).
#include "host_common.h"

namespace twcomm {

__device__ __forceinline__ uint32_t canon_word(uint32_t w) {
  if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
  if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
  return w;
}

__device__ __forceinline__ uint4 canon(uint4 v) {
  return make_uint4(canon_word(v.x), canon_word(v.y), canon_word(v.z), canon_word(v.w));
}

__device__ __forceinline__ bool lane_empty(uint32_t w) { return (w & 0xffffu) == 0x8000u || (w >> 16) == 0x8000u; }

__device__ __forceinline__ bool vec_empty(const uint4& v) {
  return lane_empty(v.x) || lane_empty(v.y) || lane_empty(v.z) || lane_empty(v.w);
}

__device__ __forceinline__ uint4 ld_volatile_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ uint4* lamport_buf(const KParams& p, int q, int buf) {
  return reinterpret_cast<uint4*>(p.peer_base[q] + p.lamport_off + (size_t)buf * p.lamport_bytes);
}

template <typename T, int N, int VPT>
__global__ void __launch_bounds__(kThreads) lamport_kernel(KParams p) {
  const uint32_t e = read_epoch(p.ctrl);
  const int buf = (int)(e % (uint32_t)kLamportBuffers);
  const int nv = p.hidden / 8;
  const uint4* x = static_cast<const uint4*>(p.x);
  // Phase 1: push own rows (canonicalized) to every rank (self included) at [src = rank][row]. The push is
  // flattened over (row, vector) and spread over the whole grid, which may hold more blocks than rows (the
  // launcher sizes it so each thread pushes about one vector): readers spin on the data, not on a per-block
  // flag, so any block may push any row, and few rows still use many SMs' store bandwidth.
  {
    const int total = p.tokens * nv;
    const int gstride = gridDim.x * kThreads;
    for (int m = blockIdx.x * kThreads + threadIdx.x; m < total; m += gstride) {
      const uint4 v = canon(x[m]);
#pragma unroll
      for (int i = 0; i < N; ++i) lamport_buf(p, (p.rank + i) % N, buf)[(size_t)p.rank * total + m] = v;
    }
  }
  // Phase 2: spin on the local copies until no lane is empty, reduce in rank order, clear, add + RMSNorm.
  uint4* mine = lamport_buf(p, p.rank, buf);
  uint4 w[VPT];
  load_weight<VPT, true>(w, p.weight, nv);
  uint4* const res_base = static_cast<uint4*>(p.residual);
  const uint4 empty = make_uint4(kLamportEmpty, kLamportEmpty, kLamportEmpty, kLamportEmpty);
  for (int row = blockIdx.x; row < p.tokens; row += gridDim.x) {
    float acc[VPT][8];
    uint4 rv[VPT];
    zero_acc(acc);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * kThreads;
      if (j < nv) {
        rv[k] = res_base[(size_t)row * nv + j];
        uint4 v[N];
#pragma unroll
        for (int q = 0; q < N; ++q) {
          uint4* src = mine + ((size_t)q * p.tokens + row) * nv + j;
          do {
            v[q] = ld_volatile_v4(src);
          } while (vec_empty(v[q]));
          *src = empty;
        }
#pragma unroll
        for (int q = 0; q < N; ++q) add_vec<T>(acc[k], v[q]);
      }
    }
    finish_row<T, VPT, true>(acc, nv, rv, w, p.weight, res_base + (size_t)row * nv, p.eps,
                             static_cast<uint4*>(p.out) + (size_t)row * nv, nullptr, nullptr);
  }
  finish_epoch(p.ctrl, e);
}

template <typename T, int N>
static void launch_lamport_vpt(const KParams& p, int grid, cudaStream_t s) {
  switch (vecs_per_thread(p.hidden)) {
    case 1: lamport_kernel<T, N, 1><<<grid, kThreads, 0, s>>>(p); break;
    case 2: lamport_kernel<T, N, 2><<<grid, kThreads, 0, s>>>(p); break;
    default: lamport_kernel<T, N, 4><<<grid, kThreads, 0, s>>>(p); break;
  }
}

template <typename T>
static void launch_lamport_n(const KParams& p, int grid, cudaStream_t s) {
  switch (p.world) {
    case 2: launch_lamport_vpt<T, 2>(p, grid, s); break;
    case 4: launch_lamport_vpt<T, 4>(p, grid, s); break;
    default: launch_lamport_vpt<T, 8>(p, grid, s); break;
  }
}

}  // namespace twcomm

using namespace twcomm;

extern "C" {

int tw_lamport_allreduce_rmsnorm(tw_workspace* ws, const void* x, void* residual, const void* weight, void* out,
                                 int tokens, int hidden, int dtype, float eps, int max_blocks, void* stream) {
  if (!ws || !ws->opened) return set_error(TW_ERR_STATE, "workspace is not opened");
  int rc = check_common(tokens, hidden, dtype, max_blocks, x, residual, weight, out);
  if (rc) return rc;
  if (!x || !out || !residual || !weight) return set_error(TW_ERR_ARG, "null tensor pointer");
  if (tokens == 0) return TW_OK;
  const size_t need = (size_t)ws->world * tokens * hidden * 2;
  if (need > ws->lamport_bytes)
    return set_error(TW_ERR_ARG, "Lamport one-shot needs %zu bytes (world*tokens*hidden*2) > its buffer %zu; "
                     "use p2p_oneshot or p2p_twoshot", need, ws->lamport_bytes);
  DeviceGuard guard(ws->device);
  KParams p = make_params(ws);
  p.x = x;
  p.residual = residual;
  p.weight = weight;
  p.out = out;
  p.tokens = tokens;
  p.hidden = hidden;
  p.eps = eps;
  // at least one block per row (the reduce), and about one pushed vector per thread (the push)
  const int push_blocks = (int)(((long long)tokens * (hidden / 8) + kThreads - 1) / kThreads);
  const int want = tokens > push_blocks ? tokens : push_blocks;
  const int grid = want < max_blocks ? want : max_blocks;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == TW_BF16) {
    launch_lamport_n<__nv_bfloat16>(p, grid, s);
  } else {
    launch_lamport_n<__half>(p, grid, s);
  }
  TW_CUDA_CHECK(cudaGetLastError());
  return TW_OK;
}

}  // extern "C"
