// tw-comm workspace: symmetric staging buffers + signal pads shared over CUDA IPC (no multicast objects),
// copy-engine side streams, error reporting, argument checks, and the standalone cross-rank barrier kernel.
#include <stdio.h>
#include <string.h>

#include <string>

#include "host_common.h"

namespace twcomm {

static thread_local std::string g_error;

int set_error(int code, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  g_error = buf;
  return code;
}

int check_common(int tokens, int hidden, int dtype, int max_blocks, const void* a, const void* b, const void* c,
                 const void* d) {
  if (tokens < 0) return set_error(TW_ERR_ARG, "tokens=%d must be >= 0", tokens);
  if (hidden <= 0 || hidden % 8 != 0 || hidden > TW_MAX_HIDDEN)
    return set_error(TW_ERR_ARG, "hidden=%d must be a positive multiple of 8 and <= %d", hidden, TW_MAX_HIDDEN);
  if (dtype != TW_BF16 && dtype != TW_FP16)
    return set_error(TW_ERR_ARG, "dtype=%d must be TW_BF16 (0) or TW_FP16 (1)", dtype);
  if (max_blocks < 1 || max_blocks > TW_MAX_BLOCKS)
    return set_error(TW_ERR_ARG, "max_blocks=%d must be in [1, %d]", max_blocks, TW_MAX_BLOCKS);
  const void* ptrs[4] = {a, b, c, d};
  for (int i = 0; i < 4; ++i) {
    if (ptrs[i] && (reinterpret_cast<uintptr_t>(ptrs[i]) & 15) != 0)
      return set_error(TW_ERR_ARG, "pointer argument %d (%p) must be 16-byte aligned", i, ptrs[i]);
  }
  return TW_OK;
}

__global__ void fill_u32_kernel(uint32_t* p, size_t n, uint32_t v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}

KParams make_params(const tw_workspace* ws) {
  KParams p;
  memset(&p, 0, sizeof(p));
  for (int q = 0; q < TW_MAX_RANKS; ++q) p.peer_base[q] = ws->peer_base[q];
  p.ctrl = ws->ctrl;
  p.rank = ws->rank;
  p.world = ws->world;
  p.slot_bytes = ws->slot_bytes;
  p.region_bytes = ws->region_bytes;
  p.fixed_slot = -1;
  p.chunk = 0;
  p.nchunks = 1;
  p.lamport_off = kPadBytes + 2 * ws->slot_bytes;
  p.lamport_bytes = ws->lamport_bytes;
  return p;
}

__global__ void barrier_kernel(KParams p) {
  const uint32_t e = read_epoch(p.ctrl);
  block_barrier(p, 2, e);
  finish_epoch(p.ctrl, e);
}

int launch_barrier(tw_workspace* ws, cudaStream_t stream) {
  KParams p = make_params(ws);
  barrier_kernel<<<1, 32, 0, stream>>>(p);
  TW_CUDA_CHECK(cudaGetLastError());
  return TW_OK;
}

}  // namespace twcomm

using namespace twcomm;

extern "C" {

const char* tw_last_error(void) { return g_error.c_str(); }

int tw_workspace_create(int device, int rank, int world, size_t max_bytes, tw_workspace** out) {
  if (!out) return set_error(TW_ERR_ARG, "out must not be NULL");
  *out = nullptr;
  if (world != 2 && world != 4 && world != 8)
    return set_error(TW_ERR_ARG, "world=%d unsupported: tw-comm kernels are built for 2, 4 or 8 ranks", world);
  if (rank < 0 || rank >= world) return set_error(TW_ERR_ARG, "rank=%d must be in [0, %d)", rank, world);
  if (max_bytes == 0) return set_error(TW_ERR_ARG, "max_bytes must be > 0");
  DeviceGuard guard(device);
  tw_workspace* ws = new tw_workspace();
  ws->device = device;
  ws->rank = rank;
  ws->world = world;
  ws->max_bytes = max_bytes;
  // n * ceil(T/n) rows exceed T by at most n-1 rows of at most TW_MAX_HIDDEN 2-byte elements.
  const size_t slack = (size_t)TW_MAX_RANKS * TW_MAX_HIDDEN * 2;
  ws->region_bytes = ((max_bytes + slack + 4095) / 4096) * 4096;
  ws->slot_bytes = 2 * ws->region_bytes;
  ws->lamport_bytes = (size_t)world * kLamportRankBytes;
  const size_t total = kPadBytes + 2 * ws->slot_bytes + kLamportBuffers * ws->lamport_bytes;
  auto fail = [&](int code) {
    tw_workspace_destroy(ws);
    return code;
  };
  cudaError_t e = cudaMalloc(&ws->base, total);
  if (e != cudaSuccess)
    return fail(set_error(TW_ERR_CUDA, "cudaMalloc(%zu) failed: %s", total, cudaGetErrorString(e)));
  ws->peer_base[rank] = ws->base;
  e = cudaMemset(ws->base, 0, kPadBytes);
  if (e == cudaSuccess) {  // every Lamport slot starts empty: the negative-zero sentinel in each 16-bit lane
    const size_t words = kLamportBuffers * ws->lamport_bytes / 4;
    fill_u32_kernel<<<256, 256>>>(reinterpret_cast<uint32_t*>(ws->base + kPadBytes + 2 * ws->slot_bytes), words,
                                  kLamportEmpty);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMalloc(&ws->ctrl, 256);
  const uint32_t init[2] = {1u, 0u};
  if (e == cudaSuccess) e = cudaMemcpy(ws->ctrl, init, sizeof(init), cudaMemcpyHostToDevice);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ws->fork, cudaEventDisableTiming);
  for (int q = 0; q < world && e == cudaSuccess; ++q) {
    e = cudaStreamCreateWithFlags(&ws->side[q], cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ws->join[q], cudaEventDisableTiming);
    for (int c = 0; c < kCeMaxChunks && e == cudaSuccess; ++c)
      e = cudaEventCreateWithFlags(&ws->push_done[c][q], cudaEventDisableTiming);
  }
  for (int c = 0; c < kCeMaxChunks && e == cudaSuccess; ++c)
    e = cudaEventCreateWithFlags(&ws->pull_fork[c], cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess)
    return fail(set_error(TW_ERR_CUDA, "workspace setup failed: %s", cudaGetErrorString(e)));
  *out = ws;
  return TW_OK;
}

int tw_workspace_ipc_handle(tw_workspace* ws, uint8_t* handle_out) {
  if (!ws || !ws->base) return set_error(TW_ERR_STATE, "workspace is not created");
  static_assert(sizeof(cudaIpcMemHandle_t) == TW_IPC_HANDLE_BYTES, "IPC handle size");
  DeviceGuard guard(ws->device);
  cudaIpcMemHandle_t h;
  TW_CUDA_CHECK(cudaIpcGetMemHandle(&h, ws->base));
  memcpy(handle_out, &h, sizeof(h));
  return TW_OK;
}

int tw_workspace_open(tw_workspace* ws, const uint8_t* all_handles) {
  if (!ws || !ws->base) return set_error(TW_ERR_STATE, "workspace is not created");
  if (ws->opened) return set_error(TW_ERR_STATE, "workspace already opened");
  DeviceGuard guard(ws->device);
  for (int q = 0; q < ws->world; ++q) {
    if (q == ws->rank) continue;
    cudaIpcMemHandle_t h;
    memcpy(&h, all_handles + (size_t)q * TW_IPC_HANDLE_BYTES, sizeof(h));
    void* ptr = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess)
      return set_error(TW_ERR_CUDA, "cudaIpcOpenMemHandle(rank %d) failed: %s", q, cudaGetErrorString(e));
    ws->peer_base[q] = static_cast<char*>(ptr);
  }
  TW_CUDA_CHECK(cudaDeviceSynchronize());
  ws->opened = true;
  return TW_OK;
}

int tw_workspace_destroy(tw_workspace* ws) {
  if (!ws) return TW_OK;
  DeviceGuard guard(ws->device);
  cudaDeviceSynchronize();
  for (int q = 0; q < TW_MAX_RANKS; ++q) {
    if (q != ws->rank && ws->peer_base[q]) cudaIpcCloseMemHandle(ws->peer_base[q]);
    if (ws->side[q]) cudaStreamDestroy(ws->side[q]);
    if (ws->join[q]) cudaEventDestroy(ws->join[q]);
    for (int c = 0; c < kCeMaxChunks; ++c)
      if (ws->push_done[c][q]) cudaEventDestroy(ws->push_done[c][q]);
  }
  for (int c = 0; c < kCeMaxChunks; ++c)
    if (ws->pull_fork[c]) cudaEventDestroy(ws->pull_fork[c]);
  if (ws->fork) cudaEventDestroy(ws->fork);
  if (ws->ctrl) cudaFree(ws->ctrl);
  if (ws->base) cudaFree(ws->base);
  delete ws;
  return TW_OK;
}

size_t tw_workspace_capacity(const tw_workspace* ws) { return ws ? ws->region_bytes : 0; }

}  // extern "C"
