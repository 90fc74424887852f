"""KV-pool sizing that keeps room for the largest forward the engine will run.

Before the KV pool is allocated, :func:`measure_activation_reserve` runs profiling forwards of the largest
shapes the scheduler can form (:func:`forward_limits`) on a small temporary KV cache and reads the peak of
PyTorch's caching allocator (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``), as vLLM's worker
does before it sizes its KV block pool (``profile_run`` / ``determine_num_available_blocks`` in vLLM, the engine of
Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention"; the paper
itself does not describe the profiling step):

* the eager peak: one forward of ``max_tokens`` tokens over ``max_rows`` requests (one prefill chunk plus
  single-token rows, as a mixed chunked-prefill step), followed by the sampler on all rows with top-k/top-p/min-p
  set (its sort is the largest sampling buffer);
* the CUDA graphs: one forward of ``graph_max_bs`` single-token rows (the largest captured decode graph), counted
  twice (graph pool + warm-up blocks cached on the capture stream), plus the float32 logits the graphs keep alive
  (``graph_rows_total x vocab x 4`` bytes: one shared ``[graph_max_bs, vocab]`` buffer by default, one buffer per
  captured size with ``SGLANG_GRAPH_SHARED_LOGITS=0``);
* :data:`HEADROOM_BYTES` for allocator fragmentation and non-PyTorch allocations made later (cuBLAS/NCCL
  workspaces of other streams).

Expert parallelism by all-to-all (``--moe-a2a-backend``): the token dispatcher's fixed buffers (low-latency send and
receive sets, or the tdist symmetric heap; :func:`moe_a2a_buffer_bytes`) are allocated when the model is installed,
before this sizing, so the free memory the pool is carved from already excludes them; the normal-mode transients
(receive rows of the largest prefill) are inside the eager peak the profiling forward measures (it runs the
all-to-all at that size on every rank).

:func:`kv_pool_bytes` then gives the pool ``free - fixed - max((1 - f) * total, reserve)``: SGLang's meaning of
``--mem-fraction-static`` f (weights + KV take at most ``f`` of the device) is kept, and the pool shrinks further
whenever the measured reserve exceeds the ``1 - f`` slack, so no batch the scheduler can form runs out of memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEADROOM_BYTES = 512 << 20  # fragmentation + non-PyTorch allocations after start (cuBLAS/NCCL workspaces)


@dataclass(frozen=True)
class ForwardLimits:
    """The largest forward shapes the scheduler can form (all counts, no units beyond tokens/rows).

    Attributes:
        max_tokens: tokens in the largest forward (a chunked-prefill step, or the largest decode batch).
        max_rows: requests (= logit rows sampled) in one forward.
        graph_max_bs: rows of the largest captured CUDA graph; 0 when graphs are off.
        graph_rows_total: rows of float32 logits the graphs keep alive: ``graph_max_bs`` with the shared logits
            buffer (the default), the sum of all captured batch sizes without it.
    """

    max_tokens: int
    max_rows: int
    graph_max_bs: int = 0
    graph_rows_total: int = 0


def forward_limits(args: "ServerArgs", max_running: int, graphs_on: bool, device=None) -> ForwardLimits:
    """The :class:`ForwardLimits` of the scheduler's rules for ``args`` and ``max_running`` requests.

    Chunked prefill on (the default, ``--chunked-prefill-size`` unset = 8192): a step holds its decode rows plus
    prefill tokens up to the chunk size, so at most ``max(chunk, max_running)`` tokens; chunking off (-1): up to
    ``--max-prefill-tokens`` prefill tokens plus ``max_running`` decode rows. Graphs capture
    :func:`~sglang.srt.model_executor.cuda_graph_runner.capture_batch_sizes` up to
    ``min(--cuda-graph-max-bs, max_running)``, the flag's default following ``device``'s memory as SGLang's
    (:func:`~sglang.srt.model_executor.cuda_graph_runner.resolved_cuda_graph_max_bs`; 160 without a device).

    Raises:
        ValueError: ``max_running < 1``.
    """
    from sglang.srt.model_executor.cuda_graph_runner import (capture_batch_sizes, graph_logits_shared,
                                                             resolved_cuda_graph_max_bs)

    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}")
    cps = args.chunked_prefill_size
    if cps is None:
        from sglang.srt.managers.scheduler import DEFAULT_CHUNKED_PREFILL_SIZE

        cps = DEFAULT_CHUNKED_PREFILL_SIZE
    if cps == -1:
        max_tokens = args.max_prefill_tokens + max_running
    else:
        max_tokens = max(cps, max_running)
    rows = min(max_running, max_tokens)
    if not graphs_on:
        return ForwardLimits(max_tokens, rows)
    sizes = capture_batch_sizes(min(resolved_cuda_graph_max_bs(args, device), max_running))
    return ForwardLimits(max_tokens, rows, sizes[-1], sizes[-1] if graph_logits_shared() else sum(sizes))


def kv_pool_bytes(free_bytes: int, total_bytes: int, mem_fraction: float, reserve_bytes: int,
                  fixed_bytes: int = 0) -> int:
    """Bytes the KV pool may take: ``free - fixed - max((1 - mem_fraction) * total, reserve)``, at least 0.

    Args:
        free_bytes: device memory free now (``torch.cuda.mem_get_info``), after the weights, the profiling
            forwards and ``torch.cuda.empty_cache()``.
        total_bytes: the device's total memory.
        mem_fraction: ``--mem-fraction-static`` in (0, 1): weights + KV take at most this share of the device.
        reserve_bytes: activation memory the engine's forwards need (see :func:`measure_activation_reserve`).
        fixed_bytes: other allocations made with the pool (the ``req_to_token`` rows).
    Raises:
        ValueError: ``mem_fraction`` outside (0, 1) or a negative byte count.
    """
    if not 0.0 < mem_fraction < 1.0:
        raise ValueError(f"--mem-fraction-static={mem_fraction} must be in (0, 1)")
    if min(free_bytes, total_bytes, reserve_bytes, fixed_bytes) < 0:
        raise ValueError(f"negative byte count: free={free_bytes} total={total_bytes} reserve={reserve_bytes} "
                         f"fixed={fixed_bytes}")
    keep = max(int(total_bytes * (1.0 - mem_fraction)), reserve_bytes)
    return max(0, free_bytes - fixed_bytes - keep)


def graph_reserve_bytes(graph_peak_bytes: int, limits: ForwardLimits, vocab_size: int) -> int:
    """The CUDA-graph estimate: twice the largest graph's forward peak (its private pool, and the blocks its eager
    warm-up forwards leave cached on the capture stream, which the default stream cannot reuse) plus the float32
    logits the graphs keep alive (``graph_rows_total x vocab_size``). 0 when graphs are off."""
    if limits.graph_max_bs == 0:
        return 0
    return 2 * graph_peak_bytes + limits.graph_rows_total * vocab_size * 4


def profiling_applies(runner: "ModelRunner", args: "ServerArgs") -> bool:
    """Profile only on CUDA, without ``--max-total-tokens``, for roles that run whole forwards locally
    (aggregated, prefill, decode); an attention worker's forward involves FFN workers that are not ready yet."""
    from sglang.srt.deployment.plan import WorkerRole

    return (runner.device.type == "cuda" and args.max_total_tokens is None
            and runner.role_spec.role in (WorkerRole.AGGREGATED, WorkerRole.PREFILL, WorkerRole.DECODE))


def _dummy_batch(runner: "ModelRunner", kv, tokens: int, rows: int, sampled: bool):
    """A ModelWorkerBatch of ``rows`` requests on ``kv``: the first with ``tokens - rows + 1`` tokens, the others
    one token each (EXTEND, no prefix); top-k/top-p/min-p sampling when ``sampled``, else greedy."""
    from sglang.srt.forward_batch_info import ForwardMode, ModelWorkerBatch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams

    lens = [tokens - rows + 1] + [1] * (rows - 1)
    req_rows = kv.req_to_token_pool.alloc(rows)
    if req_rows is None:
        raise RuntimeError(f"the KV cache has fewer than {rows} free request rows for the profiling forward")
    locs = kv.allocator.alloc(tokens)
    if locs is None:
        kv.req_to_token_pool.free(list(req_rows))
        raise RuntimeError(f"the KV cache has fewer than {tokens} free slots for the profiling forward")
    kv.req_to_token_pool.write_batch(list(req_rows), [0] * rows, lens, locs)
    params = []
    for _ in range(rows):
        p = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.9, top_k=50, min_p=0.05) if sampled \
            else SamplingParams(max_new_tokens=1, temperature=0.0)
        p.normalize(None)
        params.append(p)
    vocab = runner.model_config.vocab_size
    info = SamplingBatchInfo.from_reqs(params, runner.device, vocab, [[] for _ in range(rows)])
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    return ModelWorkerBatch(
        forward_mode=ForwardMode.EXTEND, input_ids=ids, positions=[i for n in lens for i in range(n)],
        out_cache_loc=locs, req_pool_indices=list(req_rows), prefix_lens=[0] * rows, extend_lens=lens,
        seq_lens=lens, sample=[True] * rows, top_logprobs_nums=[0] * rows, sampling_info=info)


@torch.inference_mode()
def run_dummy_forward(runner: "ModelRunner", tokens: int, rows: int, sampled: bool,
                      on_ready: Optional[Callable[[], None]] = None, kv=None) -> torch.Tensor:
    """One forward of ``tokens`` tokens over ``rows`` requests (see :func:`_dummy_batch`), + a fresh sampler's step
    when ``sampled``. ``kv``: a :class:`~sglang.srt.mem_cache.kv_cache.KVCache` to take the slots and rows from (they
    are returned afterwards); None: a temporary one of ``tokens`` slots, freed on return. The runner's sampler
    generator is untouched. ``on_ready`` runs once the inputs are built, just before the forward (the profiler resets
    its peak counters there). Returns the sampled (``sampled``) or argmax ids, ``[rows]`` int64. Works on any
    device; :func:`profile_peak_bytes` wraps it on CUDA.

    Raises:
        ValueError: ``rows`` outside ``1..tokens``.
        RuntimeError: ``kv`` has too few free slots or rows.
    """
    from sglang.srt.forward_batch_info import ForwardBatch
    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.mem_cache.kv_cache import KVCache

    if not 1 <= rows <= tokens:
        raise ValueError(f"profiling forward needs 1 <= rows <= tokens, got rows={rows} tokens={tokens}")
    mc, dev, page = runner.model_config, runner.device, runner.page_size
    own = kv is None
    if own:
        # the runner's KV format (``--kv-cache-dtype``), so the profiled forward runs the kernels serving will run
        kv = KVCache.create(max_total_tokens=tokens + 2 * page - tokens % page, page_size=page,
                            dtype=getattr(runner, "kv_cache_dtype", mc.dtype),
                            scales=getattr(runner, "kv_scales", None),
                            head_num=runner.num_kv_heads, head_dim=mc.head_dim, layer_num=mc.num_hidden_layers,
                            req_rows=rows + 1, max_context_len=tokens + 8, device=dev, disable_radix_cache=True)
    batch = _dummy_batch(runner, kv, tokens, rows, sampled)
    try:
        if on_ready is not None:
            on_ready()
        fb = ForwardBatch.init_new(batch, dev, kv.req_to_token_pool, kv.token_to_kv_pool, runner.attn_backend)
        out = runner.executor.run(runner.model, fb)
        if not sampled:
            return torch.argmax(out.next_token_logits, dim=-1)
        # a fresh Sampler: the runner's generator must not advance (seeded outputs stay as without profiling)
        return Sampler(0, dev).forward(out.next_token_logits, batch.sampling_info, False,
                                       batch.top_logprobs_nums).next_token_ids
    finally:
        if not own:
            kv.allocator.free(batch.out_cache_loc)
            kv.req_to_token_pool.free(batch.req_pool_indices)


def profile_peak_bytes(runner: "ModelRunner", tokens: int, rows: int, sampled: bool) -> int:
    """Peak bytes PyTorch's caching allocator holds (allocated or reserved, the larger) above its state before
    :func:`run_dummy_forward` of this shape, on the runner's CUDA device; ends with ``torch.cuda.empty_cache()``.

    Raises:
        RuntimeError: the forward itself runs out of memory (the message names the shape and the fix).
    """
    dev = runner.device
    base = {}

    def reset() -> None:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base["alloc"], base["res"] = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)

    try:
        run_dummy_forward(runner, tokens, rows, sampled, on_ready=reset)
        torch.cuda.synchronize(dev)
        peak = max(torch.cuda.max_memory_allocated(dev) - base["alloc"],
                   torch.cuda.max_memory_reserved(dev) - base["res"])
    except torch.OutOfMemoryError as e:
        raise RuntimeError(f"the profiling forward of {tokens} tokens over {rows} requests ran out of memory; "
                           "lower --chunked-prefill-size, --max-running-requests or --cuda-graph-max-bs") from e
    finally:
        torch.cuda.empty_cache()
    return max(0, peak)


def measure_activation_reserve(runner: "ModelRunner", args: "ServerArgs", max_running: int) -> int:
    """Bytes to keep free beside the KV pool (0 where :func:`profiling_applies` is false): the eager peak of the
    largest forward + sampling, the CUDA-graph pool estimate and :data:`HEADROOM_BYTES` (module docstring).
    Ends with ``torch.cuda.empty_cache()``, so ``mem_get_info`` read afterwards sees the memory it used as free.
    With TP every rank profiles the same shapes at the same time (the forwards run collectives)."""
    if not profiling_applies(runner, args):
        return 0
    graphs_on = not args.disable_cuda_graph and runner.attention_backend_name != "torch_native"
    lim = forward_limits(args, max_running, graphs_on, getattr(runner, "device", None))
    eager = profile_peak_bytes(runner, lim.max_tokens, lim.max_rows, sampled=True)
    graph_peak = profile_peak_bytes(runner, lim.graph_max_bs, lim.graph_max_bs, False) if lim.graph_max_bs else 0
    graph = graph_reserve_bytes(graph_peak, lim, runner.model_config.vocab_size)
    reserve = eager + graph + HEADROOM_BYTES
    logger.info("activation reserve %.0f MiB: forward of %d tokens / %d rows + sampling %.0f MiB, CUDA graphs "
                "(bs %d) %.0f MiB, headroom %.0f MiB; MoE all-to-all buffers %.0f MiB (allocated before, not in the "
                "free memory)", reserve / 2**20, lim.max_tokens, lim.max_rows, eager / 2**20, lim.graph_max_bs,
                graph / 2**20, HEADROOM_BYTES / 2**20, moe_a2a_buffer_bytes(runner) / 2**20)
    return reserve


def moe_a2a_buffer_bytes(runner: "ModelRunner") -> int:
    """Bytes of the runner's MoE all-to-all fixed buffers (0 without ``--moe-a2a-backend``): the dispatcher's
    ``buffer_bytes`` of its config."""
    disp = getattr(runner, "moe_dispatcher", None)
    return 0 if disp is None else int(disp.buffer_bytes(disp.config))


def req_to_token_bytes(rows: int, context_len: int) -> int:
    """Bytes of the ``req_to_token`` table allocated with the pool: ``rows x (context_len + 8)`` int32."""
    return 4 * rows * (context_len + 8)

