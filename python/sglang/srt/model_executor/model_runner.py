"""ModelRunner: owns the model, the KV pools, the attention backend and the sampler.

It executes exactly what the scheduler decided (a
:class:`~sglang.srt.model_executor.forward_batch_info.ModelWorkerBatch`) and
returns logits-derived results; it makes no scheduling decisions.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.attention import create_attention_backend
from sglang.srt.layers.sampler import Sampler
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.cuda_graph_runner import maybe_create_cuda_graph_runner
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ModelWorkerBatch
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536
CPU_DEFAULT_MAX_RUNNING = 256
GPU_DEFAULT_MEM_FRACTION = 0.85
GPU_DEFAULT_MAX_RUNNING = 1024
GPU_MAX_DEFAULT_TOKENS = 1 << 22  # tiny models on big GPUs: a memory-derived pool is capped here
REQ_TO_TOKEN_MAX_BYTES = 1 << 30


def set_cpu_threads(model_config: ModelConfig) -> None:
    """Pick torch's intra-op thread count for CPU serving.

    Small models run best on one thread: their ops take microseconds, and
    OpenMP workers spin-waiting on a busy machine turn them into milliseconds.
    ``SGLANG_CPU_THREADS`` overrides the choice.
    """
    env = os.environ.get("SGLANG_CPU_THREADS")
    n = int(env) if env else (1 if model_config.hidden_size < 1024 else max(1, (os.cpu_count() or 1)))
    torch.set_num_threads(n)
    logger.info("CPU intra-op threads: %d", n)


class ModelRunner:
    """Loads the model and sizes the KV cache.

    Args:
        model_config: the model's :class:`ModelConfig`.
        server_args: sizing flags (``max_total_tokens``, ``mem_fraction_static``,
            ``max_running_requests``, ``page_size``, ``load_format``, ``attention_backend``).
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).
        tp_rank, tp_size: tensor parallelism; ``tp_size > 1`` needs ``parallel_state``.
        parallel_state: the rank's :class:`~sglang.srt.distributed.parallel_state.ParallelState`.
        comm_backend: communicator backend name (default: ``server_args.comm_backend`` if that flag
            exists, else "auto"; see :func:`~sglang.srt.distributed.communicator.create_communicator`).
        comm: a ready communicator (overrides ``comm_backend``; benchmarks use it).
    Tensor parallelism: each rank holds its weight shards and a KV pool of its local KV heads
    (``num_key_value_heads / tp``, or 1 replicated head when ``tp >= num_key_value_heads``); the KV
    budget in tokens is the minimum over ranks so every rank schedules the same. Sampling: every rank
    samples from the same all-gathered logits, then rank 0's token ids are broadcast over the TP device
    group, so all ranks continue with identical tokens even where reductions are not bitwise
    reproducible across ranks (one tiny broadcast per step).
    Attention backend: ``server_args.resolved_attention_backend`` (``triton`` by default on CUDA,
    ``torch_native`` on CPU).
    CUDA graphs: on CUDA, unless ``--disable-cuda-graph`` or the ``torch_native`` backend, decode batches
    of up to ``--cuda-graph-max-bs`` requests (default 160, at most ``max_running_requests``) replay a
    graph captured at init (:mod:`~sglang.srt.model_executor.cuda_graph_runner`); padding rows use
    ``pad_req_idx``, a ``req_to_token`` row reserved here (on every device) whose slot 0 is the dummy KV
    slot 0, so the scheduler's ``max_running_requests`` (+1 spare) rows never include it. With TP every
    rank captures the same sizes and all ranks agree (MIN over the CPU group) before graphs are used.
    Raises:
        ValueError: the KV budget leaves no room for a single max-length request, or tp_size > 1
            without a parallel_state.
    """

    def __init__(self, model_config: ModelConfig, server_args: "ServerArgs", device: str, tp_rank: int = 0,
                 tp_size: int = 1, parallel_state=None, comm_backend: Optional[str] = None, comm=None):
        from sglang.srt.distributed.communicator import create_communicator
        from sglang.srt.distributed.parallel_state import all_reduce_min_int, local_kv_heads
        from sglang.srt.model_loader.loader import load_model

        if tp_size > 1 and parallel_state is None:
            raise ValueError(f"ModelRunner with tp_size={tp_size} needs a parallel_state (init_parallel_state)")
        self.model_config = model_config
        self.device = torch.device(device)
        self.tp_rank, self.tp_size, self.parallel_state = tp_rank, tp_size, parallel_state
        if self.device.type == "cpu":
            set_cpu_threads(model_config)
        self.page_size = server_args.page_size
        torch.manual_seed(server_args.random_seed)
        if comm is None:
            backend = comm_backend or getattr(server_args, "comm_backend", None) or "auto"
            comm = create_communicator(parallel_state, backend, server_args.disable_custom_all_reduce)
        self.comm = comm
        self.model = load_model(model_config, server_args.load_format, self.device, tp_rank=tp_rank,
                                tp_size=tp_size, comm=comm if tp_size > 1 else None,
                                ep_size=getattr(server_args, "ep_size", 1))
        mc = model_config
        self.num_kv_heads = local_kv_heads(mc.num_key_value_heads, tp_size)
        self.max_total_tokens = self._kv_budget_tokens(server_args)
        if tp_size > 1:
            self.max_total_tokens = all_reduce_min_int(self.max_total_tokens, parallel_state.cpu_group)
        if self.max_total_tokens < 2 * self.page_size:
            raise ValueError(
                f"the KV cache would hold only {self.max_total_tokens} tokens; raise --mem-fraction-static "
                "or --max-total-tokens"
            )
        max_running = server_args.max_running_requests or (
            GPU_DEFAULT_MAX_RUNNING if self.device.type == "cuda" else CPU_DEFAULT_MAX_RUNNING
        )
        row_bytes = 4 * (mc.context_len + 8)
        max_running = max(1, min(max_running, REQ_TO_TOKEN_MAX_BYTES // row_bytes, self.max_total_tokens))
        self.max_running_requests = max_running
        # scheduler rows: max_running (+1 spare, as before); one more row reserved for CUDA-graph padding
        self.req_to_token_pool = ReqToTokenPool(max_running + 2, mc.context_len + 8, self.device)
        self.pad_req_idx = self._reserve_pad_row()
        self.local_num_heads = mc.num_attention_heads // tp_size
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_tokens, self.page_size, mc.dtype, self.num_kv_heads, mc.head_dim,
            mc.num_hidden_layers, self.device,
        )
        self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, self.page_size, self.device)
        self.attention_backend_name = self._attention_backend_name(server_args)
        self.attn_backend = create_attention_backend(self.attention_backend_name)
        self.sampler = Sampler(server_args.random_seed, self.device)
        self.cuda_graph_runner = self._init_cuda_graphs(server_args)
        logger.info(
            "model %s loaded on %s (%s, TP rank %d/%d, %d local KV heads); KV cache %d tokens (%.1f MiB), "
            "max running requests %d; attention backend %s, CUDA graphs %s", mc.architecture, self.device, mc.dtype,
            self.tp_rank, self.tp_size, self.num_kv_heads, self.max_total_tokens,
            self.token_to_kv_pool.kv_size_bytes() / 2**20, max_running, self.attention_backend_name,
            f"up to batch {self.cuda_graph_runner.max_bs}" if self.cuda_graph_runner else "off",
        )

    def _reserve_pad_row(self) -> int:
        """Take one ``req_to_token`` row out of the scheduler's reach and zero it (its slot 0 is the
        dummy KV slot 0 that CUDA-graph padding rows read and write)."""
        rows = self.req_to_token_pool.alloc(1)
        if rows is None:  # cannot happen: the pool was just created with free rows
            raise RuntimeError("ReqToTokenPool has no free row for the CUDA-graph padding row")
        self.req_to_token_pool.req_to_token[rows[0]].zero_()
        return rows[0]

    def _attention_backend_name(self, args: "ServerArgs") -> str:
        """The explicit ``--attention-backend``, else the default for this runner's device."""
        if args.attention_backend is None and self.device.type != "cuda":
            return "torch_native"
        return args.resolved_attention_backend

    def _init_cuda_graphs(self, args: "ServerArgs"):
        """The :class:`CudaGraphRunner` or None; with TP, graphs are used only if every rank captured."""
        from sglang.srt.distributed.parallel_state import all_reduce_min_int

        runner = maybe_create_cuda_graph_runner(self, args, self.pad_req_idx,
                                                backend_name=self.attention_backend_name)
        if self.tp_size > 1:
            if all_reduce_min_int(int(runner is not None), self.parallel_state.cpu_group) == 0 and runner:
                logger.warning("CUDA graphs off: another TP rank did not capture them; decode runs eagerly")
                runner = None
        return runner

    def _kv_budget_tokens(self, args: "ServerArgs") -> int:
        mc = self.model_config
        per_token = MHATokenToKVPool.bytes_per_token(self.num_kv_heads, mc.head_dim, mc.num_hidden_layers,
                                                     mc.dtype)
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            frac = args.mem_fraction_static or GPU_DEFAULT_MEM_FRACTION
            budget = free - total * (1.0 - frac)
            tokens = min(int(budget // per_token) if budget > 0 else 0, GPU_MAX_DEFAULT_TOKENS)
        else:
            tokens = CPU_DEFAULT_MAX_TOTAL_TOKENS
        return tokens - tokens % self.page_size

    def make_sampling_info(self, reqs) -> SamplingBatchInfo:
        """Sampling tensors for the scheduler's requests (``Req`` objects), on this device.

        Requests with a grammar (``req.grammar``) contribute their allowed-token bitmask
        (``SamplingBatchInfo.vocab_mask``); batches without grammars get none.
        """
        params = [r.sampling_params for r in reqs]
        need_input = any(p.repetition_penalty != 1.0 for p in params)
        banned = [
            list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(r.eos_token_ids))
            for p, r in zip(params, reqs)
        ]
        grammars = [getattr(r, "grammar", None) for r in reqs]
        return SamplingBatchInfo.from_reqs(
            params, self.device, self.model_config.vocab_size, [r.output_ids for r in reqs],
            [r.origin_input_ids for r in reqs] if need_input else None, banned,
            grammars if any(g is not None for g in grammars) else None,
        )

    @torch.inference_mode()
    def forward(self, batch: ModelWorkerBatch):
        """Run one step.

        Decode batches that fit a captured CUDA graph replay it (see the class docstring); everything
        else runs eagerly.

        Returns:
            (LogitsProcessorOutput, SamplerOutput): logits-derived outputs and
            one sampled token per request (rows with ``sample[i] == False`` are
            sampled too and ignored by the scheduler). After a graph replay,
            ``next_token_logits`` is a view of the graph's static output: valid until the next step.
        """
        graphs = self.cuda_graph_runner
        if graphs is not None and graphs.can_run(batch):
            logits_out = graphs.replay(batch)
        else:
            fb = ForwardBatch.init_new(batch, self.device, self.req_to_token_pool, self.token_to_kv_pool,
                                       self.attn_backend)
            self.attn_backend.init_forward_metadata(fb)
            logits_out = self.model(fb.input_ids, fb.positions, fb)
        sample_out = self.sampler.forward(logits_out.next_token_logits, batch.sampling_info, batch.return_logprob,
                                          batch.top_logprobs_nums)
        if self.tp_size > 1:  # every rank continues with rank 0's tokens (see the class docstring)
            ids = sample_out.next_token_ids.contiguous()
            dist.broadcast(ids, 0, group=self.parallel_state.device_group)
            sample_out.next_token_ids = ids
        return logits_out, sample_out
