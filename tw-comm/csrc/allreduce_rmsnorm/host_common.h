// Host-side internals shared by the tw-comm translation units: the workspace struct, error reporting, checks.
#pragma once
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#include "common.cuh"
#include "tw_comm/tw_comm.h"

namespace twcomm {
constexpr int kCeMaxChunks = 4;  // copy-engine pipeline depth (row chunks of each rank's token range)
}

struct tw_workspace {
  int device = 0;
  int rank = 0;
  int world = 0;
  size_t max_bytes = 0;
  size_t region_bytes = 0;  // one staging region (input or output half of a slot)
  size_t slot_bytes = 0;    // 2 * region_bytes
  size_t lamport_bytes = 0;  // one Lamport buffer (world * kLamportRankBytes)
  char* base = nullptr;     // own allocation: [pads | slot 0 | slot 1 | Lamport buffers 0..2]
  char* peer_base[TW_MAX_RANKS] = {};
  uint32_t* ctrl = nullptr;  // local epoch + arrival counter
  bool opened = false;
  cudaStream_t side[TW_MAX_RANKS] = {};  // copy-engine side streams, one per peer
  cudaEvent_t fork = nullptr;
  cudaEvent_t join[TW_MAX_RANKS] = {};
  cudaEvent_t push_done[twcomm::kCeMaxChunks][TW_MAX_RANKS] = {};  // copy engine: chunk c pushed by side[d]
  cudaEvent_t pull_fork[twcomm::kCeMaxChunks] = {};                 // copy engine: chunk c normed everywhere
};

namespace twcomm {

// Record an error for tw_last_error() and return `code`.
int set_error(int code, const char* fmt, ...);

// Switch the calling thread to `device` for the guard's lifetime (the CUDA runtime is shared with torch).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (prev_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int cur = -1;
    cudaGetDevice(&cur);
    if (cur != prev_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
};

// Validate shapes/pointers common to every data op. Returns TW_OK or TW_ERR_ARG (with message).
int check_common(int tokens, int hidden, int dtype, int max_blocks, const void* a, const void* b, const void* c,
                 const void* d);
// Fill the pointer / size part of the kernel parameters.
KParams make_params(const tw_workspace* ws);
// Vectors (of 8 elements) per thread for a row of `hidden` elements.
inline int vecs_per_thread(int hidden) {
  const int nv = hidden / 8;
  return nv <= kThreads ? 1 : (nv <= 2 * kThreads ? 2 : 4);
}
// Launch the standalone one-block cross-rank barrier (barrier id 2) on `stream`.
int launch_barrier(tw_workspace* ws, cudaStream_t stream);
// Launch the two-shot family kernel; push/pull select the P2P phases (both off: copy-engine reduce kernel).
int launch_twoshot(tw_workspace* ws, KParams p, int dtype, bool norm, bool push, bool pull, int grid,
                   cudaStream_t stream);

// One-shot family (norm = false: plain AllReduce). Defined in oneshot.cu.
int run_oneshot(tw_workspace* ws, const void* x, void* residual, const void* weight, void* out, int tokens,
                int hidden, int dtype, float eps, int max_blocks, bool norm, void* stream);

// Checks + parameters of the two-shot family (twoshot.cu); the grid is min(max_blocks, ceil(T/N)).
int prepare_twoshot(tw_workspace* ws, const void* x, void* residual, const void* weight, void* out, int tokens,
                    int hidden, int dtype, float eps, int max_blocks, int residual_sharded, bool norm, KParams* p,
                    int* grid);

}  // namespace twcomm

#define TW_CUDA_CHECK(call)                                                                                  \
  do {                                                                                                       \
    cudaError_t e_ = (call);                                                                                 \
    if (e_ != cudaSuccess)                                                                                   \
      return ::twcomm::set_error(TW_ERR_CUDA, "%s failed: %s (%s:%d)", #call, cudaGetErrorString(e_),       \
                                 __FILE__, __LINE__);                                                        \
  } while (0)
