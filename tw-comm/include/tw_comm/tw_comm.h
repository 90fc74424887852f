// tw-comm: fused AllReduce + residual-add + RMSNorm for one process group on one host.
//
// Plain C API so that nothing but opaque handles crosses into Python (loaded via ctypes by sgl_kernel).
// Technique: TokenWeave (Gond et al. 2025), section 3.3: ReduceScatter -> residual add + RMSNorm on this
// rank's 1/N of the tokens -> AllGather, fused in one kernel; here over NVLink P2P loads/stores and copy
// engines instead of NVLS multicast (which our hosts forbid).
//
// Semantics of every *_rmsnorm entry point, per token row t (fp32 accumulation):
//   s = residual[t] + sum_ranks x_r[t];  residual[t] = s (rounded);  out[t] = s * rsqrt(mean(s^2) + eps) * weight
// x, residual, out: [T, H] row-major contiguous on this rank's device; weight: [H]; dtype bf16 or fp16;
// H % 8 == 0 and H <= 16384. Every launch is enqueued on `stream` (the caller's), is CUDA-graph capturable,
// and uses at most `max_blocks` thread blocks (one per SM): that is the SM bound.
//
// All functions return 0 on success, else a non-zero code; tw_last_error() describes the last failure of the
// calling thread.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TW_MAX_RANKS 8
#define TW_MAX_BLOCKS 256
#define TW_MAX_HIDDEN 16384
#define TW_IPC_HANDLE_BYTES 64

enum tw_dtype { TW_BF16 = 0, TW_FP16 = 1 };

enum tw_status {
  TW_OK = 0,
  TW_ERR_ARG = 1,          // bad argument (shape, dtype, rank, capacity)
  TW_ERR_CUDA = 2,         // a CUDA runtime call failed
  TW_ERR_NVLS_REFUSED = 3, // NVLS variant refused: multicast not supported or not allowed by the environment
  TW_ERR_STATE = 4,        // workspace not opened / already closed
};

typedef struct tw_workspace tw_workspace;  // opaque

// Text of the calling thread's last error (static storage, never NULL).
const char* tw_last_error(void);

// Create this rank's half of a workspace on `device`: one cudaMalloc holding the signal pads and two slots of
// staging buffers, each slot able to stage an input of `max_bytes` bytes ([T, H] * elem size). No multicast.
int tw_workspace_create(int device, int rank, int world, size_t max_bytes, tw_workspace** out);
// Copy this rank's CUDA IPC handle (TW_IPC_HANDLE_BYTES bytes) into `handle_out`.
int tw_workspace_ipc_handle(tw_workspace* ws, uint8_t* handle_out);
// Open the peers' handles: `all_handles` is world * TW_IPC_HANDLE_BYTES bytes in rank order (own entry ignored).
int tw_workspace_open(tw_workspace* ws, const uint8_t* all_handles);
// Close peer mappings, free buffers and side streams. Safe on a NULL pointer.
int tw_workspace_destroy(tw_workspace* ws);
// Bytes of one staging region (the largest n * ceil(T/n) * H * elem a call may stage).
size_t tw_workspace_capacity(const tw_workspace* ws);

// (a) P2P one-shot: every rank pushes its rows to all peers, one epoch-tagged flag barrier, local reduce+norm.
int tw_oneshot_allreduce_rmsnorm(tw_workspace* ws, const void* x, void* residual, const void* weight, void* out,
                                 int tokens, int hidden, int dtype, float eps, int max_blocks, void* stream);
// (a') Lamport one-shot (flag in the data, no barrier; small T: world*tokens*hidden*2 <= world * 2 MiB), same
// arguments and result as (a).
int tw_lamport_allreduce_rmsnorm(tw_workspace* ws, const void* x, void* residual, const void* weight, void* out,
                                 int tokens, int hidden, int dtype, float eps, int max_blocks, void* stream);
// (b) P2P two-shot: ReduceScatter by peer stores -> residual+RMSNorm on own 1/N tokens -> AllGather by peer loads.
// residual_sharded != 0: only this rank's token range of `residual` is updated (TokenWeave's sharded residual;
// saves one AllGather); else the whole residual is gathered too.
int tw_twoshot_allreduce_rmsnorm(tw_workspace* ws, const void* x, void* residual, const void* weight, void* out,
                                 int tokens, int hidden, int dtype, float eps, int max_blocks,
                                 int residual_sharded, void* stream);
// (b') pipelined P2P two-shot: same result as (b); per-chunk flags let the push of one chunk, the pull of another
// and the local reduce + norm of a third overlap (no whole-tensor barrier). chunk_bytes: bytes of one peer's rows
// per chunk (0: TW_PIPE_CHUNK_BYTES); smaller chunks pipeline deeper at more flag round trips.
#define TW_PIPE_CHUNK_BYTES 32768
int tw_twoshot_pipe_allreduce_rmsnorm(tw_workspace* ws, const void* x, void* residual, const void* weight,
                                      void* out, int tokens, int hidden, int dtype, float eps, int max_blocks,
                                      int residual_sharded, int chunk_bytes, void* stream);
// (b'') bulk-copy P2P two-shot: same result and arguments as (b); the push and pull phases move data with Hopper
// bulk asynchronous copies (cp.async.bulk through a shared-memory ring, one issuing thread per block), so few CTAs
// (max_blocks 8-32) keep enough bytes in flight for NVLink line rate. Needs sm_90.
int tw_twoshot_bulk_allreduce_rmsnorm(tw_workspace* ws, const void* x, void* residual, const void* weight,
                                      void* out, int tokens, int hidden, int dtype, float eps, int max_blocks,
                                      int residual_sharded, void* stream);
// (c) copy-engine variant: scatter and gather by cudaMemcpyAsync peer copies on side streams (no SMs), and a
// reduce+residual+RMSNorm kernel on `max_blocks` SMs (target <= 8).
int tw_ce_allreduce_rmsnorm(tw_workspace* ws, const void* x, void* residual, const void* weight, void* out,
                            int tokens, int hidden, int dtype, float eps, int max_blocks, int residual_sharded,
                            void* stream);
// (e) plain AllReduce (no norm): out = sum_ranks x. variant 0 = one-shot, 1 = two-shot.
int tw_allreduce(tw_workspace* ws, const void* x, void* out, int tokens, int hidden, int dtype, int variant,
                 int max_blocks, void* stream);
// Local fused residual-add + RMSNorm (no communication; baseline and world-size-1 path).
int tw_fused_add_rmsnorm(const void* x, void* residual, const void* weight, void* out, int tokens, int hidden,
                         int dtype, float eps, int max_blocks, void* stream);

// (d) NVLS multimem variant. tw_nvls_gate returns TW_OK only when multicast is allowed by the environment
// (NCCL_NVLS_ENABLE != 0, TORCH_SYMM_MEM_DISABLE_MULTICAST and NVSHMEM_DISABLE_NVLS unset/false) AND the device
// reports multicast support; otherwise TW_ERR_NVLS_REFUSED with the reason in tw_last_error(). The environment
// is checked first, before any driver query. tw-comm never creates multicast objects: the launcher needs a
// multicast address `mc_base` (and the same memory's local unicast view `uc_base`, laid out as [input | normed
// out | residual], T*H elements each) mapped by the caller; it runs only after the gate passes. Compiled to
// LDGMC.E.ADD.{BF16,F16}x8 + STG.E.128.STRONG.SYS (multimem.st) on sm_90a.
int tw_nvls_gate(int device);
int tw_nvls_allreduce_rmsnorm(tw_workspace* ws, void* uc_base, void* mc_base, const void* x, void* residual,
                              const void* weight, void* out, int tokens, int hidden, int dtype, float eps,
                              int max_blocks, void* stream);

#ifdef __cplusplus
}
#endif
