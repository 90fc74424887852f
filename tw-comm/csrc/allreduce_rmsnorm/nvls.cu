// (d) NVLS multimem AllReduce + residual add + RMSNorm: the paper's own kernel form (TokenWeave section 3.3,
// multimem.ld_reduce / multimem.st on an NVLink-SHARP multicast mapping).
//
// SAFETY: NVLink multicast is forbidden on our hosts (a program using it can take the shared host's GPUs out
// of service). tw-comm therefore never creates multicast objects (no cuMulticast* call exists in this library),
// and tw_nvls_allreduce_rmsnorm refuses to launch unless tw_nvls_gate() passes: the environment must allow
// multicast (NCCL_NVLS_ENABLE not 0, TORCH_SYMM_MEM_DISABLE_MULTICAST and NVSHMEM_DISABLE_NVLS not set true),
// checked before any driver query, and the device must report CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED.
// The kernel is compiled so its PTX/SASS can be inspected.
//
// Layout of the caller-mapped buffer (uc_base = local unicast view, mc_base = multicast view of the same
// memory): [input: T*H][normed out: T*H][residual: T*H] elements.
#include <cuda.h>
#include <stdlib.h>
#include <strings.h>

#include "host_common.h"

namespace twcomm {

template <typename T>
__device__ __forceinline__ uint4 multimem_ld_reduce_add(const uint4* mc_addr);
template <>
__device__ __forceinline__ uint4 multimem_ld_reduce_add<__nv_bfloat16>(const uint4* mc_addr) {
  uint4 v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.bf16x2 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(mc_addr)
               : "memory");
  return v;
}
template <>
__device__ __forceinline__ uint4 multimem_ld_reduce_add<__half>(const uint4* mc_addr) {
  uint4 v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f16x2 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(mc_addr)
               : "memory");
  return v;
}

__device__ __forceinline__ void multimem_st(uint4* mc_addr, const uint4& v) {
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1,%2,%3,%4};" ::"l"(mc_addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

template <typename T, int N, int VPT>
__global__ void __launch_bounds__(kThreads) nvls_kernel(KParams p, uint4* uc, uint4* mc) {
  const uint32_t e = read_epoch(p.ctrl);
  const int nv = p.hidden / 8;
  const size_t plane = (size_t)p.tokens * nv;
  const int stride = (p.tokens + N - 1) / N;
  const uint4* x = static_cast<const uint4*>(p.x);
  // Copy the rows every rank's block b will reduce into the local (unicast) input plane.
  for (int i = blockIdx.x; i < stride; i += gridDim.x) {
    for (int q = 0; q < N; ++q) {
      const int s = owned_start(p.tokens, N, q);
      if (i >= owned_start(p.tokens, N, q + 1) - s) continue;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int j = threadIdx.x + k * kThreads;
        if (j < nv) uc[(size_t)(s + i) * nv + j] = x[(size_t)(s + i) * nv + j];
      }
    }
  }
  block_barrier(p, 0, e);
  const int ms = owned_start(p.tokens, N, p.rank);
  const int mc_rows = owned_start(p.tokens, N, p.rank + 1) - ms;
  for (int i = blockIdx.x; i < mc_rows; i += gridDim.x) {
    const size_t row = (size_t)(ms + i);
    float acc[VPT][8];
    uint4 rv[VPT], w[VPT];
    zero_acc(acc);
    load_weight<VPT, true>(w, p.weight, nv);
    uint4* res_row = static_cast<uint4*>(p.residual) + row * nv;
    uint4* out_row = static_cast<uint4*>(p.out) + row * nv;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * kThreads;
      if (j < nv) {
        rv[k] = res_row[j];
        add_vec<T>(acc[k], multimem_ld_reduce_add<T>(mc + row * nv + j));
      }
    }
    finish_row<T, VPT, true>(acc, nv, rv, w, p.weight, res_row, p.eps, out_row, nullptr, nullptr);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = threadIdx.x + k * kThreads;
      if (j < nv) {
        multimem_st(mc + plane + row * nv + j, out_row[j]);
        if (!p.residual_sharded) multimem_st(mc + 2 * plane + row * nv + j, res_row[j]);
      }
    }
  }
  block_barrier(p, 1, e);
  for (int i = blockIdx.x; i < stride; i += gridDim.x) {
    for (int q = 0; q < N; ++q) {
      const int s = owned_start(p.tokens, N, q);
      if (q == p.rank || i >= owned_start(p.tokens, N, q + 1) - s) continue;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int j = threadIdx.x + k * kThreads;
        if (j < nv) {
          const size_t off = (size_t)(s + i) * nv + j;
          static_cast<uint4*>(p.out)[off] = __ldcg(uc + plane + off);
          if (!p.residual_sharded) static_cast<uint4*>(p.residual)[off] = __ldcg(uc + 2 * plane + off);
        }
      }
    }
  }
  finish_epoch(p.ctrl, e);
}

static bool env_is_false(const char* v) {
  return !strcasecmp(v, "0") || !strcasecmp(v, "false") || !strcasecmp(v, "no") || !strcasecmp(v, "off");
}
static bool env_is_true(const char* v) {
  return !strcasecmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes") || !strcasecmp(v, "on");
}

template <typename T, int N>
static void launch_nvls_vpt(const KParams& p, uint4* uc, uint4* mc, int grid, cudaStream_t s) {
  switch (vecs_per_thread(p.hidden)) {
    case 1: nvls_kernel<T, N, 1><<<grid, kThreads, 0, s>>>(p, uc, mc); break;
    case 2: nvls_kernel<T, N, 2><<<grid, kThreads, 0, s>>>(p, uc, mc); break;
    default: nvls_kernel<T, N, 4><<<grid, kThreads, 0, s>>>(p, uc, mc); break;
  }
}

template <typename T>
static void launch_nvls(const KParams& p, uint4* uc, uint4* mc, int grid, cudaStream_t s) {
  switch (p.world) {
    case 2: launch_nvls_vpt<T, 2>(p, uc, mc, grid, s); break;
    case 4: launch_nvls_vpt<T, 4>(p, uc, mc, grid, s); break;
    default: launch_nvls_vpt<T, 8>(p, uc, mc, grid, s); break;
  }
}

}  // namespace twcomm

using namespace twcomm;

extern "C" {

int tw_nvls_gate(int device) {
  // Environment first: a refusal here never touches the driver.
  const char* v = getenv("NCCL_NVLS_ENABLE");
  if (v && env_is_false(v))
    return set_error(TW_ERR_NVLS_REFUSED, "NVLS refused: NCCL_NVLS_ENABLE=%s disables NVLink multicast", v);
  v = getenv("TORCH_SYMM_MEM_DISABLE_MULTICAST");
  if (v && env_is_true(v))
    return set_error(TW_ERR_NVLS_REFUSED, "NVLS refused: TORCH_SYMM_MEM_DISABLE_MULTICAST=%s", v);
  v = getenv("NVSHMEM_DISABLE_NVLS");
  if (v && env_is_true(v)) return set_error(TW_ERR_NVLS_REFUSED, "NVLS refused: NVSHMEM_DISABLE_NVLS=%s", v);
  // Then the device's capability, through the driver entry point (no libcuda link needed).
  typedef CUresult (*GetAttr)(int*, CUdevice_attribute, CUdevice);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuDeviceGetAttribute", &fn, 12000, cudaEnableDefault, &q) !=
          cudaSuccess ||
      !fn)
    return set_error(TW_ERR_NVLS_REFUSED, "NVLS refused: cuDeviceGetAttribute entry point unavailable");
  int supported = 0;
  if (reinterpret_cast<GetAttr>(fn)(&supported, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, device) != CUDA_SUCCESS ||
      !supported)
    return set_error(TW_ERR_NVLS_REFUSED, "NVLS refused: device %d does not support multicast", device);
  return TW_OK;
}

int tw_nvls_allreduce_rmsnorm(tw_workspace* ws, void* uc_base, void* mc_base, const void* x, void* residual,
                              const void* weight, void* out, int tokens, int hidden, int dtype, float eps,
                              int max_blocks, void* stream) {
  if (!ws || !ws->opened) return set_error(TW_ERR_STATE, "workspace is not opened");
  int rc = tw_nvls_gate(ws->device);
  if (rc) return rc;
  if (!uc_base || !mc_base)
    return set_error(TW_ERR_ARG, "NVLS needs a caller-mapped multicast buffer (uc_base and mc_base)");
  rc = check_common(tokens, hidden, dtype, max_blocks, x, residual, weight, out);
  if (rc || tokens == 0) return rc;
  DeviceGuard guard(ws->device);
  KParams p = make_params(ws);
  p.x = x;
  p.residual = residual;
  p.weight = weight;
  p.out = out;
  p.tokens = tokens;
  p.hidden = hidden;
  p.eps = eps;
  const int stride = (tokens + ws->world - 1) / ws->world;
  const int grid = stride < max_blocks ? stride : max_blocks;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  uint4* uc = static_cast<uint4*>(uc_base);
  uint4* mc = static_cast<uint4*>(mc_base);
  if (dtype == TW_BF16) launch_nvls<__nv_bfloat16>(p, uc, mc, grid, s);
  else launch_nvls<__half>(p, uc, mc, grid, s);
  TW_CUDA_CHECK(cudaGetLastError());
  return TW_OK;
}

}  // extern "C"
