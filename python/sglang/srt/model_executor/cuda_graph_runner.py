"""CUDA graphs for decode batches (``--cuda-graph-max-bs``, ``--disable-cuda-graph``).

Decode steps of small batches are launch-bound: dozens of kernels per layer
each take a few microseconds to launch. We capture the model's forward once
per padded batch size and replay it, copying the real batch into static
input buffers first. Padding rows read and write only the reserved dummy KV
slot 0 through a reserved ``req_to_token`` row, and their logits are dropped.

Each graph also computes the argmax of its logits into a static int64 buffer (always on,
formerly the ``SGLANG_GRAPH_GREEDY`` switch: on one H100 it cut the host time in
``ModelRunner.forward`` at batch 1/32/128 with no cost in the replay), and
:meth:`CudaGraphRunner.greedy_ids` hands those ids to the runner for batches whose
every row is plain greedy (:func:`graph_greedy_eligible`), so the sampler's launches
are skipped for them; other batches are sampled eagerly from the logits.

Inputs: one packed host-to-device copy per replay from a persistent pinned buffer
(:class:`~sglang.srt.model_executor.graph_inputs.DecodeInputStager`). The attention backend
must be graph-safe for decode (no host syncs, metadata read from the static tensors): the Triton
backend is, ``torch_native`` is not.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.layers import decode_gemm
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch
from sglang.srt.model_executor.graph_inputs import DecodeInputStager
from sglang.srt.model_executor.overlap_worker import resolve_future_ids

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 160  # SGLang's --cuda-graph-max-bs when the device memory is unknown
SHARED_LOGITS_ENV = "SGLANG_GRAPH_SHARED_LOGITS"


def default_cuda_graph_max_bs(device_memory_bytes: Optional[int], tp_size: int = 1) -> int:
    """``--cuda-graph-max-bs`` when unset, by device memory as SGLang picks it (``ServerArgs._handle_gpu_memory_settings``
    of SGLang 0.5): < 20 GiB: 8; < 35 GiB: 24 (80 at TP >= 4); < 60 GiB: 32 (160 at TP >= 4); < 160 GiB (H100, H200,
    A100-80G): 256 (512 at TP >= 4); larger: 512; unknown (None, e.g. no CUDA device): 160.

    Args:
        device_memory_bytes: total memory of one device, bytes (``torch.cuda.mem_get_info()[1]``), or None.
        tp_size: tensor-parallel ranks.
    """
    if device_memory_bytes is None:
        return DEFAULT_MAX_BS
    gib = device_memory_bytes / (1 << 30)
    big_tp = tp_size >= 4
    if gib < 20:
        return 8
    if gib < 35:
        return 80 if big_tp else 24
    if gib < 60:
        return 160 if big_tp else 32
    if gib < 160:
        return 512 if big_tp else 256
    return 512


def resolved_cuda_graph_max_bs(server_args, device=None) -> int:
    """``--cuda-graph-max-bs``, else :func:`default_cuda_graph_max_bs` of ``device``'s memory (CUDA) and
    ``--tp-size``; off CUDA (or ``device`` None) the unknown-memory default."""
    if server_args.cuda_graph_max_bs:
        return server_args.cuda_graph_max_bs
    mem = None
    if device is not None and torch.device(device).type == "cuda":
        mem = torch.cuda.mem_get_info(torch.device(device))[1]
    return default_cuda_graph_max_bs(mem, getattr(server_args, "tp_size", 1) or 1)


def graph_logits_shared() -> bool:
    """Whether every captured decode graph writes its float32 logits into one shared ``[max_bs, vocab]`` buffer (the
    default) instead of keeping a ``[bs, vocab]`` output per captured size alive (``SGLANG_GRAPH_SHARED_LOGITS=0``, the
    behaviour before; 0.87 GB of Llama-3 logits over the sizes up to 160, 2.2 GB up to 256). The pool's size follows
    ``--mem-fraction-static`` while the measured reserve stays below its slack, so this frees memory beside the pool
    (what lets graphs up to 256 and the 0.88 default fit) rather than growing it. Replays never overlap and the sampler reads a replay's logits before the next replay in stream order, so
    one buffer is enough. Raises ValueError for a value other than 0/1."""
    val = os.environ.get(SHARED_LOGITS_ENV, "1").strip() or "1"
    if val not in ("0", "1"):
        raise ValueError(f"{SHARED_LOGITS_ENV}={val!r}: use 1 (one shared logits buffer, default) or 0 (one per size)")
    return val == "1"


def graph_greedy_eligible(batch: ModelWorkerBatch) -> bool:
    """True when the sampler would return exactly ``argmax(logits)`` for every row of ``batch``: all rows greedy
    (temperature 0 / top_k 1), no penalty, ``min_new_tokens`` ban or ``logit_bias`` (``need_penalties``), no custom
    logit processor, no grammar mask, no logprobs requested. Then the argmax captured in the graph is the
    sampler's result (same op on the same logits)."""
    info = batch.sampling_info
    return (info is not None and info.is_all_greedy and not info.need_penalties
            and info.custom_logit_processors is None and info.vocab_mask is None and not batch.return_logprob)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """Padded batch sizes to capture, SGLang's list: 1, 2, 4, 8, 12, every 8 from 16 to 256, every 16 from 272 to
    496, every 32 from 512, cut at ``max_bs`` (always included)."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {max_bs}")
    sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(range(512, max_bs + 1, 32))
    sizes = [b for b in sizes if b <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    """Captures and replays the decode forward of ``runner.model``.

    Args:
        runner: the :class:`ModelRunner` (model, pools, attention backend on a CUDA device).
        max_bs: largest batch captured; larger decode batches run eagerly.
        pad_req_idx: a ``req_to_token`` row reserved for padding, whose slot 0 is the dummy KV slot.
        batch_sizes: the padded sizes to capture (ascending, each in 1..``max_bs``, ``max_bs`` included); None:
            :func:`capture_batch_sizes` (benchmarks capture a few sizes to save start time).
        shared_logits: every graph writes its logits into one ``[max_bs, vocab]`` float32 buffer (see
            :func:`graph_logits_shared`, which None reads).
    Raises:
        ValueError: a bad ``batch_sizes``.
        RuntimeError: capture failed (e.g. an op synchronizes with the host); the caller
            logs it and runs eagerly.
    """

    def __init__(self, runner: "ModelRunner", max_bs: int, pad_req_idx: int, batch_sizes: Optional[list] = None,
                 shared_logits: Optional[bool] = None):
        self.runner = runner
        self.greedy_outputs: dict[int, torch.Tensor] = {}  # padded bs -> [bs] int64 argmax, written by replays
        self.device = runner.device
        if batch_sizes is not None and (list(batch_sizes) != sorted(set(batch_sizes)) or batch_sizes[-1] != max_bs
                                        or batch_sizes[0] < 1):
            raise ValueError(f"CUDA graph batch sizes {batch_sizes} must be ascending, distinct, in 1..{max_bs} "
                             f"and end with max_bs={max_bs}")
        self.batch_sizes = list(batch_sizes) if batch_sizes is not None else capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.pad_req_idx = pad_req_idx
        n = self.max_bs
        i64 = dict(dtype=torch.int64, device=self.device)
        self.inputs = DecodeInputStager(n, pad_req_idx, self.device)  # one host->device copy per replay
        self.input_ids, self.positions, self.req_pool_indices, self.seq_lens, self.out_cache_loc = self.inputs.views()
        self.ones = torch.ones(n, **i64)
        self.arange = torch.arange(n, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.shared_logits = graph_logits_shared() if shared_logits is None else bool(shared_logits)
        # allocated before capture, outside the graphs' pool: every replay writes its rows [:bs] here
        self.logits_buffer = torch.empty(n, runner.model_config.vocab_size, dtype=torch.float32,
                                         device=self.device) if self.shared_logits else None
        self.pool = None
        # an executor whose step talks to remote workers on the device (AFD over cuda_push[_ll]) is captured itself,
        # with its hooks around each replay; otherwise the plain forward is (the executor's stages are equal to it)
        ex = getattr(runner, "executor", None)
        self.staged = ex if getattr(ex, "graph_captures_executor", False) else None
        mc = runner.model_config
        backend = runner.attn_backend
        if hasattr(backend, "init_cuda_graph_state"):
            heads = runner.local_num_heads
            kv_heads = runner.token_to_kv_pool.head_num
            backend.init_cuda_graph_state(self.max_bs, heads, mc.head_dim, kv_heads, self.device)
        # GEMM autotune: per (linear shape, batch bucket) cuBLAS or a skinny GEMM config, measured here before capture
        # (SGLANG_DECODE_GEMM_AUTOTUNE=1); None leaves every linear on cuBLAS
        # (SGLANG_DECODE_FUSE_EPILOGUE=1 adds the epilogue fusions, only under the sequential executor: another
        # one may slice or ship a projection's output)
        self.decode_gemm_table = decode_gemm.maybe_autotune(
            runner.model, self.batch_sizes, self.device, rank=getattr(runner, "tp_rank", 0),
            fuse_ok=getattr(ex, "name", "sequential") == "sequential" and self.staged is None)
        decode_gemm.install(runner.model, self.decode_gemm_table)
        self._capture_all()

    def _forward_batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            prefix_lens=self.seq_lens[:bs] - 1, extend_lens=self.ones[:bs], extend_start_loc=self.arange[:bs],
            seq_lens_cpu=[1] * bs, prefix_lens_cpu=[0] * bs, extend_lens_cpu=[1] * bs,
            req_to_token_pool=r.req_to_token_pool, token_to_kv_pool=r.token_to_kv_pool, attn_backend=r.attn_backend,
            logits_buffer=self.logits_buffer[:bs] if self.logits_buffer is not None else None,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        with torch.cuda.device(self.device):
            self._capture_sizes()

    def _capture_sizes(self) -> None:
        if self.staged is not None and hasattr(self.staged, "prepare_graph_capture"):
            self.staged.prepare_graph_capture()  # e.g. AFD: the FFN workers are reachable (warm-ups talk to them)
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        stream = torch.cuda.Stream(self.device)
        dp = getattr(self.runner, "dp_attention", None)
        backend = self.runner.attn_backend
        # a backend that plans on the host per batch (FlashInfer) gives each graph its own metadata and re-plans it
        # before every replay (plan_graph_replay); the others' metadata only references the static buffers
        init_meta = getattr(backend, "init_graph_metadata", backend.init_forward_metadata)
        self.replan = getattr(backend, "plan_graph_replay", None)
        self.forward_batches: dict[int, ForwardBatch] = {}
        for bs in reversed(self.batch_sizes):  # largest first so smaller graphs reuse its memory pool
            if dp is not None:  # DP attention: the MoE all-gathers of this graph carry bs rows per rank
                dp.begin_forward_rows(bs)
            fb = self._forward_batch(bs)
            init_meta(fb)
            self.forward_batches[bs] = fb
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up (Triton autotune/JIT, allocator)
                    self._forward(fb)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self._forward(fb)
                ids = torch.argmax(out.next_token_logits, dim=-1)
            self.pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out.next_token_logits
            self.greedy_outputs[bs] = ids
        torch.cuda.synchronize(self.device)
        used = (free0 - torch.cuda.mem_get_info(self.device)[0]) / 2**20
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s (%.0f MiB)", self.batch_sizes,
                    time.perf_counter() - t0, used)

    def _forward(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        """The forward captured: the staged executor's ``run`` (see ``__init__``; it builds the attention metadata
        itself) or the attention metadata then the model's own forward. The metadata is built inside the capture
        because it may hold device work that must follow the replayed inputs (the Triton backend's row order)."""
        if self.staged is not None:
            return self.staged.run(self.runner.model, fb)
        self.runner.attn_backend.init_forward_metadata(fb)
        return self.runner.model(fb.input_ids, fb.positions, fb)

    def padded_size(self, bs: int) -> int:
        """The captured batch size a decode batch of ``bs`` requests replays (ValueError above ``max_bs``)."""
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"decode batch size {bs} is outside the captured range 1..{self.max_bs}")
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def can_run(self, batch: ModelWorkerBatch) -> bool:
        """Decode batches of 1..``max_bs`` requests that ask for no input logprobs."""
        return (batch.forward_mode == ForwardMode.DECODE and 1 <= batch.batch_size <= self.max_bs
                and not any(batch.input_logprob_indices))

    @torch.inference_mode()
    def replay(self, batch: ModelWorkerBatch, padded: Optional[int] = None) -> LogitsProcessorOutput:
        """Run a decode batch through the captured graph of the next padded size (placeholder input ids resolved
        from ``batch.future_token_ids`` on the device when it is set).

        ``padded``: the captured size to replay instead (DP attention: the size every DP rank agreed on, at least
        ``batch_size``; an idle rank replays it with 0 rows, padding only).
        Returns logits for the real rows only: ``[batch_size, vocab]`` float32.
        Raises:
            ValueError: ``padded`` is not a captured size or is smaller than the batch.
        """
        bs = batch.batch_size
        if padded is None:
            padded = self.padded_size(bs)
        elif padded not in self.graphs or padded < bs:
            raise ValueError(f"replay: padded size {padded} is not a captured size >= batch size {bs} "
                             f"(captured: {self.batch_sizes})")
        self.inputs.stage(batch, padded)  # padding rows: token 0 at position 0 of the pad row, KV slot 0
        ring = getattr(batch, "future_token_ids", None)
        if ring is not None:  # overlap with device futures: placeholders -> tokens of the previous batch
            self.input_ids[:bs].copy_(resolve_future_ids(self.input_ids[:bs], ring))
        if self.replan is not None:  # padding rows: sequence length 1 (the pad row's dummy slot)
            self.replan(self.forward_batches[padded], [int(n) for n in batch.seq_lens] + [1] * (padded - bs))
        if self.staged is not None:
            self.staged.before_graph_replay(padded)  # e.g. AFD: announce the step to the FFN workers
        self.graphs[padded].replay()
        if self.staged is not None:
            self.staged.after_graph_replay()  # e.g. AFD: fail closed on a peer that did not answer
        return LogitsProcessorOutput(next_token_logits=self.outputs[padded][:bs])

    def greedy_ids(self, batch: ModelWorkerBatch, padded: Optional[int] = None) -> Optional[torch.Tensor]:
        """After :meth:`replay` of ``batch``: its next token ids ``[batch_size]`` int64 on the device (a view of the
        graph's static argmax output, valid until the next replay, like the logits) when
        :func:`graph_greedy_eligible` holds; else None (sample from the logits). ``padded``: the size that
        :meth:`replay` was given (DP attention's agreed size; None: the batch's own padded size)."""
        if not graph_greedy_eligible(batch):
            return None
        bs = batch.batch_size
        return self.greedy_outputs[padded if padded is not None else self.padded_size(bs)][:bs]


def maybe_create_cuda_graph_runner(runner: "ModelRunner", server_args, pad_req_idx: Optional[int],
                                   backend_name: Optional[str] = None):
    """A :class:`CudaGraphRunner` when the device, backend and flags allow; else None (logged).

    ``backend_name``: the runner's attention backend (default ``server_args.resolved_attention_backend``).
    Graphs are off on non-CUDA devices, with ``--disable-cuda-graph``, without a pad row, with the
    ``torch_native`` backend, or when capture fails (logged; decode then runs eagerly).
    """
    if runner.device.type != "cuda" or server_args.disable_cuda_graph or pad_req_idx is None:
        return None
    if (backend_name or server_args.resolved_attention_backend) == "torch_native":
        logger.info("CUDA graphs off: the torch_native attention backend is not graph-safe")
        return None
    max_bs = min(resolved_cuda_graph_max_bs(server_args, runner.device), runner.max_running_requests)
    try:
        return CudaGraphRunner(runner, max_bs, pad_req_idx)
    except Exception as e:  # capture is best effort: eager decode is always correct
        logger.warning("CUDA graph capture failed (%s: %s); decode runs eagerly", type(e).__name__, e)
        try:
            torch.cuda.synchronize(runner.device)
        except RuntimeError as e2:  # a broken capture may leave an error behind; eager mode will surface it
            logger.warning("CUDA synchronize after the failed capture: %s", e2)
        return None
