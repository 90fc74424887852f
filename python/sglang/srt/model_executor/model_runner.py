"""ModelRunner: owns the model, the KV pools, the attention backend and the sampler.

It executes exactly what the scheduler decided (a
:class:`~sglang.srt.forward_batch_info.ModelWorkerBatch`) and
returns logits-derived results; it makes no scheduling decisions.
"""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.attention import create_attention_backend
from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.sampler import Sampler, SamplerOutput
from sglang.srt.mem_cache.kv_cache import KVCache
from sglang.srt.mem_cache.memory_budget import measure_activation_reserve, req_to_token_bytes
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.cuda_graph_runner import maybe_create_cuda_graph_runner
from sglang.srt.model_executor.overlap_worker import resolve_future_ids
from sglang.srt.model_executor.executors import ExecutorContext, ModelExecutor, build_executor
from sglang.srt.model_executor.worker_builder import (
    GPU_MAX_DEFAULT_TOKENS, RoleSpec, WorkerRole, kv_budget_tokens, max_running_requests, role_spec,
    set_cpu_threads,
)
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

if TYPE_CHECKING:
    from sglang.srt.deployment.plan import WorkerSpec
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def build_sampling_info(reqs, device: torch.device, vocab_size: int) -> SamplingBatchInfo:
    """A fresh :class:`SamplingBatchInfo` on ``device`` for ``reqs`` (``Req`` objects or views of them): their
    sampling params, stop/EOS ids (banned under ``min_new_tokens`` unless ``ignore_eos``), outputs so far, prompts
    (only when a repetition penalty needs them), grammars, per-token logprob ids and custom logit processors."""
    params = [r.sampling_params for r in reqs]
    need_input = any(p.repetition_penalty != 1.0 for p in params)
    banned = [
        list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(r.eos_token_ids))
        for p, r in zip(params, reqs)
    ]
    grammars = [getattr(r, "grammar", None) for r in reqs]
    return SamplingBatchInfo.from_reqs(
        params, device, vocab_size, [r.output_ids for r in reqs],
        [r.origin_input_ids for r in reqs] if need_input else None, banned,
        grammars if any(g is not None for g in grammars) else None,
        token_ids_logprobs=[getattr(r, "token_ids_logprob", None) for r in reqs],
        custom_logit_processors=[getattr(r, "custom_logit_processor", None) for r in reqs],
    )


def step_independent(info: SamplingBatchInfo) -> bool:
    """True when ``info`` would be rebuilt identically at the next decode step of the same requests: nothing in it
    depends on the tokens generated so far (no frequency/presence/repetition penalty, no active min_new_tokens ban,
    no logit_bias, no seeded row, no grammar mask, no custom logit processor, no per-token logprob ids)."""
    return (not info.need_penalties and not info.has_seeded_rows and info.vocab_mask is None
            and info.custom_logit_processors is None
            and not any(t for t in (info.token_ids_logprobs or [])))


class ModelRunner:
    """A model worker: the model (or a role's part of it), its KV cache, the attention backend, the executor
    and the sampler.

    Args:
        model_config: the model's :class:`ModelConfig`.
        server_args: sizing flags (``max_total_tokens``, ``mem_fraction_static``,
            ``max_running_requests``, ``page_size``, ``load_format``, ``attention_backend``,
            ``disable_radix_cache``, ``ep_size``).
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``), explicit: the launcher passes the index it was given.
        tp_rank, tp_size: tensor parallelism inside this worker's role; ``tp_size > 1`` needs ``parallel_state``.
        parallel_state: the rank's :class:`~sglang.srt.distributed.parallel_state.ParallelState`.
        comm: a ready communicator (overrides the spec's; benchmarks use it).
        role: the worker's :class:`~sglang.srt.deployment.plan.WorkerRole` when no ``worker`` spec is given (default
            aggregated): decides the weights loaded (:attr:`RoleSpec.weight_filter`) and whether a KV cache is
            allocated.
        executor: a ready executor (overrides the spec's; tests use it).
        worker: the :class:`~sglang.srt.deployment.plan.WorkerSpec` this runner carries out: role, executor spec
            (made by the executor registry after the model loads), communicator spec. Default: the spec a worker
            built from ``server_args`` gets (:func:`~sglang.srt.deployment.compose.single_worker_spec`).
        alive: the launcher's liveness, for executors that wait on remote peers (AFD).
        dp_attention: the worker's :class:`~sglang.srt.dp_attention.rank.DpAttentionRank` under DP attention (then
            ``tp_size`` is 1: attention, dense layers and logits are replicated; the loader shards the experts over
            the DP world; the KV budget and CUDA-graph use are agreed over the DP ranks; a batch's ``dp_step`` sets
            the MoE padding, picks the graph size every rank replays, and an ``IDLE`` batch runs the idle forward).
    Construction, one helper per job: CPU threads and seed; communicator; model load (role's weights);
    KV sizing (minimum over TP ranks); :class:`~sglang.srt.mem_cache.kv_cache.KVCache`; the CUDA-graph
    padding row; attention backend, sampler, executor; CUDA graphs.
    Tensor parallelism: each rank holds its weight shards and a KV pool of its local KV heads
    (``num_key_value_heads / tp``, or 1 replicated head when ``tp >= num_key_value_heads``); the KV
    budget in tokens is the minimum over ranks so every rank schedules the same. Sampling: every rank
    samples from the same all-gathered logits, then rank 0's token ids are broadcast over the TP device
    group, so all ranks continue with identical tokens even where reductions are not bitwise
    reproducible across ranks (one tiny broadcast per step).
    CUDA graphs: on CUDA, unless ``--disable-cuda-graph`` or the ``torch_native`` backend, decode batches
    of up to ``--cuda-graph-max-bs`` requests replay a graph captured at init
    (:mod:`~sglang.srt.model_executor.cuda_graph_runner`); padding rows use ``pad_req_idx``, a
    ``req_to_token`` row reserved here whose slot 0 is the dummy KV slot 0. With TP every rank captures
    the same sizes and all ranks agree (MIN over the CPU group) before graphs are used.
    Raises:
        ValueError: the KV budget leaves no room for a single page, tp_size > 1 without a
            parallel_state, or an unknown role.
    """

    def __init__(self, model_config: ModelConfig, server_args: "ServerArgs", device: str, tp_rank: int = 0,
                 tp_size: int = 1, parallel_state=None, comm=None, role: "WorkerRole | str" = WorkerRole.AGGREGATED,
                 executor: Optional[ModelExecutor] = None, worker: Optional["WorkerSpec"] = None,
                 alive: Optional[Callable[[], bool]] = None, dp_attention=None):
        from sglang.srt.deployment.communicator import make_communicator
        from sglang.srt.deployment.compose import single_worker_spec
        from sglang.srt.distributed.parallel_state import local_kv_heads

        if tp_size > 1 and parallel_state is None:
            raise ValueError(f"ModelRunner with tp_size={tp_size} needs a parallel_state (init_parallel_state)")
        self.model_config = model_config
        self.role_spec: RoleSpec = role_spec(worker.role if worker is not None else role)
        self.worker = worker if worker is not None else single_worker_spec(server_args, self.role_spec.role)
        self.device = torch.device(device)
        self.tp_rank, self.tp_size, self.parallel_state = tp_rank, tp_size, parallel_state
        self.dp_attention = dp_attention
        if self.device.type == "cpu":
            set_cpu_threads(model_config)
        self.page_size = server_args.page_size
        torch.manual_seed(server_args.random_seed)
        self.comm = comm if comm is not None else make_communicator(self.worker.communicator, parallel_state,
                                                                     hidden_size=model_config.hidden_size)
        self.model = self._load_model(server_args)
        self.moe_dispatcher = self._install_moe_a2a(server_args)  # before the KV pool is sized (its buffers count)
        self.num_kv_heads = local_kv_heads(model_config.num_key_value_heads, tp_size)
        self.local_num_heads = model_config.num_attention_heads // tp_size
        self.executor: ModelExecutor = executor or build_executor(self.worker.executor, ExecutorContext(
            worker=self.worker, model=self.model, model_config=model_config, device=self.device, tp_size=tp_size,
            parallel_state=parallel_state, args=server_args, alive=alive))
        self.sampler = Sampler(server_args.random_seed, self.device)
        self._sampling_cache: Optional[tuple] = None  # (rids, params, info) of the last step-independent batch
        self.attention_backend_name = self._attention_backend_name(server_args)
        self.attn_backend = create_attention_backend(self.attention_backend_name)
        if self.role_spec.holds_kv:
            self.kv_cache: Optional[KVCache] = self._create_kv_cache(server_args)
            self.pad_req_idx: Optional[int] = self._reserve_pad_row()
            self.cuda_graph_runner = self._init_cuda_graphs(server_args)
        else:  # e.g. an FFN worker: experts only, no KV, no attention batches
            self.kv_cache, self.pad_req_idx, self.cuda_graph_runner = None, None, None
            self.max_running_requests = 0
        from sglang.srt.model_loader.role_build import param_bytes

        self.param_bytes = param_bytes(self.model)
        self.kv_bytes = self.token_to_kv_pool.kv_size_bytes() if self.kv_cache else 0
        logger.info("role %s holds %d parameter bytes (%.1f MiB) and %d KV bytes (%.1f MiB)",
                    self.role_spec.role.value, self.param_bytes, self.param_bytes / 2**20, self.kv_bytes,
                    self.kv_bytes / 2**20)
        logger.info(
            "model %s loaded on %s (%s, role %s, TP rank %d/%d, %d local KV heads); KV cache %d tokens (%.1f MiB, %s, "
            "%s layout, --kv-cache-layout %s), "
            "max running requests %d; attention backend %s, executor %s, CUDA graphs %s", model_config.architecture,
            self.device, model_config.dtype, self.role_spec.role.value, self.tp_rank, self.tp_size, self.num_kv_heads,
            self.max_total_tokens, self.token_to_kv_pool.kv_size_bytes() / 2**20 if self.kv_cache else 0.0,
            str(self.token_to_kv_pool.dtype).replace("torch.", "") if self.kv_cache else "-",
            self.token_to_kv_pool.layout if self.kv_cache else "-", server_args.kv_cache_layout,
            self.max_running_requests,
            self.attention_backend_name, self.executor.name,
            f"up to batch {self.cuda_graph_runner.max_bs}" if self.cuda_graph_runner else "off",
        )

    # ---- construction steps ----------------------------------------------------------------------------
    def _load_model(self, args: "ServerArgs"):
        """The model with this role's weights (see :func:`~sglang.srt.model_loader.loader.load_model`)."""
        from sglang.srt.model_loader.loader import load_model

        dp = self.dp_attention
        return load_model(self.model_config, args.load_format, self.device, tp_rank=self.tp_rank,
                          tp_size=self.tp_size, comm=self.comm if self.tp_size > 1 else None,
                          ep_size=1 if dp is not None else args.ep_size,
                          weight_filter=self.role_spec.weight_filter, holds_param=self.role_spec.holds_param,
                          layout=dp.layout if dp is not None else None, quantization=args.quantization)

    def _install_moe_a2a(self, args: "ServerArgs"):
        """Expert parallelism by all-to-all when the plan asks for it (``worker.moe_a2a``): one token dispatcher for
        this rank, installed on every MoE block (:func:`~sglang.srt.expert_parallel.install.install_moe_a2a`;
        collective over the EP group). Under DP attention the DP rank builds it over the DP world with the ``local``
        token scope (:meth:`~sglang.srt.dp_attention.rank.DpAttentionRank.install_moe_a2a`). Returns it, or None."""
        if self.worker.moe_a2a is None:
            return None
        rows = max_running_requests(args, self.device, self.model_config.context_len, GPU_MAX_DEFAULT_TOKENS)
        if self.dp_attention is not None:
            return self.dp_attention.install_moe_a2a(self.model, self.worker.moe_a2a, args, self.device, rows)
        from sglang.srt.expert_parallel.install import install_moe_a2a

        return install_moe_a2a(self.model, self.worker.moe_a2a, self.parallel_state, args, self.device, rows)

    def _create_kv_cache(self, args: "ServerArgs") -> KVCache:
        """Size the KV budget (minimum over TP ranks) and allocate the :class:`KVCache`.

        Rows: ``max_running`` for the scheduler (+1 spare, as before) and one reserved for CUDA-graph padding.
        On CUDA the budget keeps the activation memory measured by profiling forwards free
        (:mod:`~sglang.srt.mem_cache.memory_budget`).
        Raises ValueError when the budget holds fewer than two pages.
        """
        from sglang.srt.distributed.parallel_state import all_reduce_min_int

        mc = self.model_config
        self.kv_cache_dtype, self.kv_scales = self._kv_format(args)
        # bytes per token at the KV cache's element size: an FP8 cache fits twice the tokens of a BF16 one
        per_token = MHATokenToKVPool.bytes_per_token(self.num_kv_heads, mc.head_dim, mc.num_hidden_layers,
                                                     self.kv_cache_dtype)
        rows = max_running_requests(args, self.device, mc.context_len, GPU_MAX_DEFAULT_TOKENS)  # before the KV cap
        reserve = measure_activation_reserve(self, args, rows)  # profiling forwards (0 off CUDA)
        self.activation_reserve_bytes = reserve
        tokens = kv_budget_tokens(args, self.device, per_token, self.page_size, reserve,
                                  req_to_token_bytes(rows + 2, mc.context_len))
        if self.tp_size > 1:
            tokens = all_reduce_min_int(tokens, self.parallel_state.cpu_group)
        if self.dp_attention is not None:  # any DP rank can take any request the front end accepts
            tokens = self.dp_attention.agree_min(tokens)
        if tokens < 2 * self.page_size:
            raise ValueError(f"the KV cache would hold only {tokens} tokens; raise --mem-fraction-static "
                             "or --max-total-tokens")
        self.max_running_requests = max_running_requests(args, self.device, mc.context_len, tokens)
        return KVCache.create(max_total_tokens=tokens, page_size=self.page_size, dtype=self.kv_cache_dtype,
                              head_num=self.num_kv_heads, head_dim=mc.head_dim, layer_num=mc.num_hidden_layers,
                              req_rows=self.max_running_requests + 2, max_context_len=mc.context_len + 8,
                              device=self.device, disable_radix_cache=args.disable_radix_cache,
                              layout=args.resolved_kv_cache_layout, scales=self.kv_scales)

    def _kv_format(self, args: "ServerArgs"):
        """``(storage dtype, KVScales or None)`` of the KV cache: ``--kv-cache-dtype`` resolved against the model dtype
        (:func:`~sglang.srt.mem_cache.kv_quant.resolve_kv_cache_dtype`); FP8 caches take the checkpoint's per-layer
        ``k_scale`` / ``v_scale`` (else 1.0, :func:`~sglang.srt.model_loader.kv_scales.kv_scales_for`).
        Raises ValueError for an unsupported name or malformed checkpoint scales."""
        from sglang.srt.mem_cache.kv_quant import is_fp8, resolve_kv_cache_dtype
        from sglang.srt.model_loader.kv_scales import kv_scales_for
        from sglang.srt.model_loader.loader import safetensors_files

        mc = self.model_config
        dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, mc.dtype)
        if not is_fp8(dtype):
            return dtype, None
        return dtype, kv_scales_for(args.load_format, lambda: safetensors_files(mc.path), mc.num_hidden_layers,
                                    args.kv_cache_dtype)

    # ---- the KV cache's parts, for worker-side code (CUDA graphs, bench_one_batch); the scheduler uses kv_cache
    @property
    def max_total_tokens(self) -> int:
        """Usable KV slots (whole pages); 0 for a role without KV."""
        return self.kv_cache.max_total_tokens if self.kv_cache else 0

    @property
    def req_to_token_pool(self):
        """The KV cache's request rows (None for a role without KV)."""
        return self.kv_cache.req_to_token_pool if self.kv_cache else None

    @property
    def token_to_kv_pool(self) -> Optional[MHATokenToKVPool]:
        """The KV cache's region (None for a role without KV)."""
        return self.kv_cache.token_to_kv_pool if self.kv_cache else None

    @property
    def allocator(self):
        """The KV cache's page allocator (None for a role without KV)."""
        return self.kv_cache.allocator if self.kv_cache else None

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
        if self.dp_attention is not None and self.dp_attention.lockstep:  # every DP rank replays, or none does
            self.dp_attention.begin_forward_rows(None)  # the captures set it per size
            if self.dp_attention.agree_min(int(runner is not None)) == 0 and runner:
                logger.warning("CUDA graphs off: another DP rank did not capture them; decode runs eagerly")
                runner = None
        return runner

    def dp_graph_size(self, bs: int) -> Optional[int]:
        """DP attention: the captured batch a decode batch of ``bs`` rows replays (None: no graph fits)."""
        g = self.cuda_graph_runner
        return g.padded_size(bs) if g is not None and 1 <= bs <= g.max_bs else None

    def make_sampling_info(self, reqs) -> SamplingBatchInfo:
        """Sampling tensors for the scheduler's requests (``Req`` objects), on this device.

        Requests with a grammar (``req.grammar``) contribute their allowed-token bitmask
        (``SamplingBatchInfo.vocab_mask``); batches without grammars get none.
        Reuse: when the same requests (``rid`` and ``sampling_params`` object, in order) ask again and the
        last result does not depend on the step (:func:`step_independent`: no penalty, min_new_tokens ban, seeded row,
        grammar, custom processor or per-token logprob list), that object is returned as is; building it costs
        0.4-1.4 ms of host time at 128 rows (benchmark/decode/host_step.py), and a decode batch keeps its requests
        for many steps. The sampler only reads it.
        """
        params = [r.sampling_params for r in reqs]
        try:
            rids = [r.rid for r in reqs]
        except AttributeError:  # request-like objects without ids (tests): never reused
            rids = None
        cached = getattr(self, "_sampling_cache", None)  # test doubles borrow this method without __init__
        if (cached is not None and rids is not None and cached[0] == rids and len(cached[1]) == len(params)
                and all(map(operator.is_, cached[1], params))):
            return cached[2]
        info = build_sampling_info(reqs, self.device, self.model_config.vocab_size)
        # the params objects are held with the rids, so no other object can take their identity while cached
        self._sampling_cache = (rids, params, info) if rids is not None and step_independent(info) else None
        return info

    @torch.inference_mode()
    def forward(self, batch: ModelWorkerBatch):
        """Run one step.

        Decode batches that fit a captured CUDA graph replay it (see the class docstring); everything
        else runs eagerly through :attr:`executor`.
        Negative input ids are overlap placeholders, resolved on the device from ``batch.future_token_ids``.

        Returns:
            (LogitsProcessorOutput, SamplerOutput): logits-derived outputs and
            one sampled token per request (rows with ``sample[i] == False`` are
            sampled too and ignored by the scheduler). After a graph replay,
            ``next_token_logits`` is a view of the graph's static output: valid until the next step.
        ``batch.gpu_timing`` (the step trace's two CUDA events), when set, is recorded on the current stream around
        the whole step.
        """
        if self.kv_cache is None:
            raise ValueError(f"a {self.role_spec.role.value} worker holds no KV cache and runs no attention batches")
        timing = getattr(batch, "gpu_timing", None)  # step trace: CUDA events around the whole forward
        if timing is not None:
            timing[0].record()
        graphs = self.cuda_graph_runner
        greedy_ids = None
        step = getattr(batch, "dp_step", None)  # DP attention: what every rank does this step
        if self.dp_attention is not None:
            self.dp_attention.begin_forward(step)
            if batch.forward_mode == ForwardMode.IDLE:
                return self._forward_idle(batch, step)
        if step is not None and graphs is not None:  # DP: every rank replays the agreed size, or none does
            use_graph, padded = step.graph_bs > 0, step.graph_bs
        else:
            use_graph, padded = graphs is not None and graphs.can_run(batch), None
        if use_graph:
            logits_out = graphs.replay(batch, padded)
            greedy_ids = graphs.greedy_ids(batch, padded)  # all-greedy: the argmax captured in the graph
        else:
            fb = ForwardBatch.init_new(batch, self.device, self.req_to_token_pool, self.token_to_kv_pool,
                                       self.attn_backend)
            if getattr(batch, "future_token_ids", None) is not None:  # overlap with device futures
                fb.input_ids = resolve_future_ids(fb.input_ids, batch.future_token_ids)
            if step is not None:  # DP attention: what every rank agreed on (MoE all-to-all mode, micro-batch split)
                fb.moe_dispatch_mode, fb.dp_step = step.moe_dispatch_mode, step
            logits_out = self.executor.run(self.model, fb)
        if greedy_ids is not None:
            sample_out = SamplerOutput(next_token_ids=greedy_ids)
        else:
            sample_out = self.sampler.forward(logits_out.next_token_logits, batch.sampling_info,
                                              batch.return_logprob, batch.top_logprobs_nums)
        if self.tp_size > 1:  # every rank continues with rank 0's tokens (see the class docstring)
            ids = sample_out.next_token_ids.contiguous()
            dist.broadcast(ids, 0, group=self.parallel_state.device_group)
            sample_out.next_token_ids = ids
        if timing is not None:
            timing[1].record()
        return logits_out, sample_out

    def _forward_idle(self, batch: ModelWorkerBatch, step):
        """DP attention, a rank without tokens this step: the agreed graph replayed with padding rows only, or the
        eager idle forward (every MoE layer's collectives with no local rows). Returns empty results (nothing is
        sampled)."""
        graphs = self.cuda_graph_runner
        if step is not None and step.graph_bs > 0 and graphs is not None:
            graphs.replay(batch, step.graph_bs)
        else:
            self.dp_attention.run_idle(self.model, self.model_config.dtype, self.device, step)
        empty = torch.empty(0, self.model_config.vocab_size, dtype=torch.float32, device=self.device)
        return (LogitsProcessorOutput(next_token_logits=empty),
                SamplerOutput(next_token_ids=torch.empty(0, dtype=torch.int64, device=self.device)))
