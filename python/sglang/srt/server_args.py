"""Command-line arguments of the server, as one frozen dataclass.

``ServerArgs`` is built once (from the CLI or from keyword arguments) and
passed explicitly to every component; nothing reads global arguments. Flag
names and defaults follow SGLang's ``launch_server``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from sglang.srt.configs.default_model import DEFAULT_MODEL, EMBEDDED_MODELS, TINY_RANDOM_MODEL  # noqa: F401
from sglang.srt.server_args_help import SERVER_ARGS_HELP


# The flag that sets an ``Optional[bool]`` field to False (the field's own flag sets True; neither: None, the default)
FALSE_FLAGS = {"tokenweave_sharded_residual": "--tokenweave-full-residual",
               "enable_mixed_chunk": "--disable-mixed-chunk"}


@dataclass(frozen=True)
class ServerArgs:
    """All server settings. See ``python -m sglang.launch_server --help``.

    Raises (from :meth:`__post_init__`):
        ValueError: a setting is out of range; the message names the flag and the fix.
    """

    # Model and tokenizer
    model_path: str = DEFAULT_MODEL
    tokenizer_path: Optional[str] = None
    served_model_name: Optional[str] = None
    load_format: str = "auto"  # auto | safetensors | dummy
    quantization: Optional[str] = None  # None | fp8 (an FP8 checkpoint's quantization_config is detected without it)
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    kv_cache_dtype: str = "auto"  # auto | bf16 | bfloat16 | fp8_e4m3 | fp8_e5m2 (SGLang's names; see mem_cache/kv_quant.py)
    device: str = "auto"  # auto | cpu | cuda
    context_length: Optional[int] = None
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False
    chat_template: Optional[str] = None  # a Jinja template string or a path to a .jinja file

    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None
    enable_metrics: bool = False
    enable_custom_logit_processor: bool = False  # SECURITY: runs client-supplied code (trusted clients only)
    max_request_body_mb: float = 32.0  # larger bodies get HTTP 413
    max_n: int = 128  # most samples per prompt (`n`); larger gets HTTP 400

    # Memory and scheduling
    mem_fraction_static: Optional[float] = None
    max_total_tokens: Optional[int] = None
    max_running_requests: Optional[int] = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: Optional[int] = None
    # prefill chunks in the decode step: None (neither flag) = on, as this server always did; SGLang's default is
    # off (see resolved_enable_mixed_chunk)
    enable_mixed_chunk: Optional[bool] = None
    schedule_policy: str = "fcfs"  # fcfs | lpm
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    page_size: int = 1
    attention_backend: Optional[str] = None  # torch_native | triton | flashinfer
    stream_interval: int = 1
    incremental_streaming_output: bool = False  # streamed /generate chunks carry deltas (SGLang's flag)
    grammar_backend: str = "xgrammar"  # xgrammar | none
    constrained_json_disable_any_whitespace: bool = False
    cuda_graph_max_bs: Optional[int] = None
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False
    enable_overlap_schedule: bool = False  # force overlap on CPU (it is on by default on CUDA)

    # Parallelism
    tp_size: int = 1
    ep_size: int = 1
    moe_a2a_backend: str = "none"  # none (all-reduce EP) | nccl | tdist: expert parallelism by all-to-all
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None  # host:port of rank 0 for multi-node
    dist_timeout: Optional[int] = None  # seconds for rendezvous and collectives (default 1800)
    disable_custom_all_reduce: bool = False
    comm_backend: str = "auto"  # auto | torch | custom | nocomm (benchmarks only) | module:factory
    base_gpu_id: int = 0  # first GPU index of this node's workers
    gpu_id_step: int = 1  # GPU index step between consecutive workers
    zmq_transport: str = "ipc"  # ipc | tcp: transport of the inter-process sockets (tcp: workers may be remote)
    # Data-parallel attention (SGLang's DP attention): --dp-size schedulers, attention replicated, MoE over EP
    dp_size: int = 1
    enable_dp_attention: bool = False
    load_balance_method: str = "shortest_queue"  # round_robin | shortest_queue: the router over DP schedulers

    # Ray (--use-ray: every worker is a Ray actor placed by placement groups; needs the `ray` extra)
    use_ray: bool = False
    ray_address: str = "auto"  # the cluster to join: auto = the running one (ray start / ray job submit)
    ray_spread_roles: bool = False  # all role groups in one STRICT_SPREAD placement group (roles on distinct nodes)
    ray_cpus_per_worker: float = 1.0  # Ray CPUs each TP rank reserves
    ray_gpus_per_worker: float = 1.0  # Ray GPUs each TP rank reserves on CUDA (< 1: ranks share a GPU, tests only)
    ray_worker_resources: Optional[str] = None  # JSON dict of extra Ray resources per worker, e.g. '{"node_a": 0.01}'
    ray_placement_timeout: float = 300.0  # seconds to wait for the placement groups before failing

    # TokenWeave (compute-communication overlap of two token splits)
    enable_tokenweave: bool = False
    tokenweave_min_tokens: Optional[int] = None  # None: auto per TP size (sglang.srt.tokenweave)
    tokenweave_comm_sms: Optional[int] = None
    # None: the default, sharded (split forwards keep 1/TP of the residual rows); True: --tokenweave-sharded-residual;
    # False: --tokenweave-full-residual (every rank keeps every residual row)
    tokenweave_sharded_residual: Optional[bool] = None
    # Triton-distributed: sequence-parallel layout with fused AG-GEMM / GEMM-RS (dense decoders, TP > 1)
    enable_tdist_overlap: bool = False
    tdist_overlap_min_tokens: Optional[int] = None  # None: auto from the calibration tables (sequence_parallel_select)
    # Two-batch overlap (SGLang's flags): two micro-batches per batch, one's communication under the other's compute
    enable_two_batch_overlap: bool = False
    tbo_token_distribution_threshold: float = 0.48  # SGLang's default; 0: never cut inside a request
    tbo_min_tokens: Optional[int] = None  # None: auto per GPU and EP size (sglang.srt.two_batch_overlap.auto_off)
    # Correctness-only test mode: every TP rank of this node on --base-gpu-id, the device group over gloo
    # (NCCL refuses two ranks per GPU), tw-comm over CUDA IPC within the device; no CUDA graphs, no custom AR.
    tp_ranks_share_gpu: bool = False

    # Prefill/decode disaggregation (KVDirect; see docs/pd_disaggregation.md)
    disaggregation_mode: str = "null"  # null | prefill | decode
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "nixl"  # nixl | fake
    disaggregation_transfer_mode: str = "pull"  # pull | push
    disaggregation_bootstrap_timeout: float = 30.0  # s a decode request waits for its prefill (CONNECT + ready)
    disaggregation_transfer_timeout: float = 30.0  # s a posted KV transfer may take
    disaggregation_heartbeat_interval: float = 1.0  # s between heartbeats to peers with open rooms
    disaggregation_heartbeat_timeout: float = 5.0  # s of silence after which a peer's rooms are failed/freed
    disaggregation_push_wait_timeout: float = 0.5  # push: s a prefill request waits for its RoomRequest (0: never)
    disaggregation_verify: bool = False  # checksum each transferred request's KV (tests)
    disaggregation_nixl_threads: int = 0  # nixl/UCX: dedicated transfer threads a request's reads are split over
    kv_cache_layout: str = "auto"  # auto | layer_major | token_major (see resolved_kv_cache_layout)
    # MegaScale-Infer attention/FFN disaggregation (MoE decode; docs/afd.md)
    enable_afd: bool = False
    afd_attention_workers: int = 1  # data parallel attention workers (each --tp ranks, its own requests and KV)
    afd_ffn_workers: int = 1  # expert-parallel FFN workers (routed experts only)
    afd_micro_batches: int = 2  # m of the ping-pong pipeline
    afd_max_tokens: int = 4096  # most tokens of one micro-batch (sizes the M2N registered buffers)
    afd_transport: str = "auto"  # auto | inline | cuda_ipc | cuda_push | cuda_push_ll | nccl | nixl
    afd_timeout_s: float = 60.0  # an FFN answer later than this fails the batch (never a hang)
    afd_redundant_experts: int = 0  # replicas of hot experts the load balancer may add (over all FFN workers)
    afd_rebalance_interval: int = 0  # steps between expert placement updates (0: static placement)

    # Misc
    random_seed: int = 0
    watchdog_timeout: float = 300.0  # seconds a scheduler loop iteration may take before the server stops
    log_level: str = "info"
    log_requests: bool = False
    decode_log_interval: int = 40  # decode steps between the scheduler's "Decode batch." log lines (SGLang's)

    def __post_init__(self) -> None:
        def bad(flag: str, value, fix: str) -> None:
            """Raise ValueError naming ``--flag``, its value and the fix."""
            raise ValueError(f"--{flag}={value!r} is invalid: {fix}")

        if self.load_format not in ("auto", "safetensors", "dummy"):
            bad("load-format", self.load_format, "use auto, safetensors or dummy")
        if self.quantization is not None:
            from sglang.srt.layers.quantization import QUANTIZATION_METHODS

            if self.quantization not in QUANTIZATION_METHODS:
                bad("quantization", self.quantization, f"use {' or '.join(QUANTIZATION_METHODS)}, or omit it (an FP8 "
                    "checkpoint is detected from its config.json)")
            if self.enable_tdist_overlap:
                bad("quantization", self.quantization, "--enable-tdist-overlap's fused kernels take model-dtype "
                    "weights; drop one of the two")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"):
            bad("dtype", self.dtype, "use auto, float32, float16 or bfloat16")
        if self.device not in ("auto", "cpu", "cuda"):
            bad("device", self.device, "use auto, cpu or cuda")
        from sglang.srt.mem_cache.kv_quant import check_kv_cache_dtype

        # ValueError naming the value and the supported ones; every attention backend (torch_native, triton,
        # flashinfer) and the prefix-free extend paths read an FP8 cache with its scales
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.schedule_policy not in ("fcfs", "lpm"):
            bad("schedule-policy", self.schedule_policy, "use fcfs or lpm")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            bad("mem-fraction-static", self.mem_fraction_static, "use a fraction in (0, 1)")
        for name in ("max_total_tokens", "max_running_requests", "context_length", "chunked_prefill_size"):
            v = getattr(self, name)
            if v is not None and v <= 0 and not (name == "chunked_prefill_size" and v == -1):
                bad(name.replace("_", "-"), v, "use a positive integer")
        if self.page_size < 1:
            bad("page-size", self.page_size, "use a positive integer")
        if self.tp_size < 1:
            bad("tp-size", self.tp_size, "use a positive integer")
        if self.attention_backend not in (None, "torch_native", "triton", "flashinfer"):
            bad("attention-backend", self.attention_backend, "use torch_native, triton or flashinfer")
        if self.attention_backend == "flashinfer":
            import importlib.util

            if importlib.util.find_spec("flashinfer") is None:  # found, not imported: the server imports it lazily
                bad("attention-backend", "flashinfer", 'FlashInfer is not installed; pip install "sglang[flashinfer]" '
                    "(or: pip install flashinfer-python apache-tvm-ffi), or use triton")
        if self.grammar_backend not in ("xgrammar", "none"):
            bad("grammar-backend", self.grammar_backend, "use xgrammar or none")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            bad("ep-size", self.ep_size, f"use a divisor of --tp-size ({self.tp_size})")
        self._check_moe_a2a(bad)
        if self.base_gpu_id < 0:
            bad("base-gpu-id", self.base_gpu_id, "use a GPU index >= 0")
        if self.gpu_id_step < 1:
            bad("gpu-id-step", self.gpu_id_step, "use a step >= 1")
        if self.tokenweave_min_tokens is not None and self.tokenweave_min_tokens < 2:
            bad("tokenweave-min-tokens", self.tokenweave_min_tokens, "use >= 2 (a split needs two tokens)")
        if self.tokenweave_comm_sms is not None and not 1 <= self.tokenweave_comm_sms <= 256:
            bad("tokenweave-comm-sms", self.tokenweave_comm_sms, "use an SM count in [1, 256]")
        if self.tokenweave_sharded_residual is not None and not self.enable_tokenweave:
            flag = "sharded" if self.tokenweave_sharded_residual else "full"
            bad(f"tokenweave-{flag}-residual", True,
                "add --enable-tokenweave (it applies to TokenWeave's split forwards) or drop the flag")
        if self.tdist_overlap_min_tokens is not None and self.tdist_overlap_min_tokens < 0:
            bad("tdist-overlap-min-tokens", self.tdist_overlap_min_tokens, "use >= 0 (0: the layout for every batch)")
        if self.enable_tdist_overlap and self.enable_tokenweave:
            bad("enable-tdist-overlap", True, "use either --enable-tdist-overlap or --enable-tokenweave, not both")
        if not 0.0 <= self.tbo_token_distribution_threshold <= 0.5:
            bad("tbo-token-distribution-threshold", self.tbo_token_distribution_threshold,
                "use a fraction in [0, 0.5] (0: never cut inside a request)")
        if self.tbo_min_tokens is not None and (self.tbo_min_tokens < 2 or not self.enable_two_batch_overlap):
            bad("tbo-min-tokens", self.tbo_min_tokens, "use >= 2 (a split needs two tokens) together with "
                "--enable-two-batch-overlap")
        if self.tp_ranks_share_gpu:
            # the test mode's collectives run on gloo (not graph-capturable; no symmetric-memory custom AR)
            object.__setattr__(self, "disable_cuda_graph", True)
            object.__setattr__(self, "disable_custom_all_reduce", True)
        self._check_runtime(bad)
        self._check_dp(bad)
        self._check_disaggregation(bad)
        if self.enable_afd:
            self._check_afd(bad)
        if not 1 <= self.port <= 65535:
            bad("port", self.port, "use a TCP port in 1..65535")

    def _check_moe_a2a(self, bad) -> None:
        """Validate ``--moe-a2a-backend`` against ``--ep-size`` (``bad(flag, value, fix)`` raises)."""
        if self.moe_a2a_backend == "deepep":
            bad("moe-a2a-backend", self.moe_a2a_backend,
                "DeepEP is not part of this server; use nccl (torch.distributed all-to-all, any GPU or CPU) or tdist "
                "(Triton-distributed low-latency all-to-all, one node), or none (all-reduce expert parallelism)")
        if self.moe_a2a_backend not in ("none", "nccl", "tdist"):
            bad("moe-a2a-backend", self.moe_a2a_backend, "use none, nccl or tdist")
        if self.moe_a2a_backend == "none":
            return
        if self.ep_size < 2:
            bad("moe-a2a-backend", self.moe_a2a_backend,
                f"expert parallelism by all-to-all needs --ep-size > 1; add --ep-size {max(2, self.tp_size)} "
                f"(= --tp-size) or use --moe-a2a-backend none")
        if self.ep_size != self.tp_size:
            bad("moe-a2a-backend", self.moe_a2a_backend,
                f"the all-to-all keeps every expert whole on one rank: set --ep-size equal to --tp-size "
                f"({self.tp_size}), got --ep-size {self.ep_size}")

    def _check_runtime(self, bad) -> None:
        """Validate the transport, multi-node, Ray and request-limit flags (``bad(flag, value, fix)`` raises)."""
        if self.zmq_transport not in ("ipc", "tcp"):
            bad("zmq-transport", self.zmq_transport, "use ipc or tcp")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            bad("node-rank", self.node_rank, f"use 0..{self.nnodes - 1} (--nnodes={self.nnodes})")
        if self.dist_timeout is not None and self.dist_timeout <= 0:
            bad("dist-timeout", self.dist_timeout, "use a positive number of seconds")
        if self.ray_cpus_per_worker < 0:
            bad("ray-cpus-per-worker", self.ray_cpus_per_worker, "use a number of CPUs >= 0")
        if not 0 < self.ray_gpus_per_worker <= 1:
            bad("ray-gpus-per-worker", self.ray_gpus_per_worker, "use a fraction in (0, 1] (one GPU per worker at "
                "most; < 1 only with --tp-ranks-share-gpu)")
        if self.ray_worker_resources is not None:
            self.ray_extra_resources()  # validates
        if self.ray_placement_timeout <= 0:
            bad("ray-placement-timeout", self.ray_placement_timeout, "use a positive number of seconds")
        if self.nnodes > 1 and not self.dist_init_addr and not self.use_ray:
            bad("dist-init-addr", self.dist_init_addr, "multi-node runs need --dist-init-addr HOST:PORT of node 0")
        if self.decode_log_interval < 1:
            bad("decode-log-interval", self.decode_log_interval, "use a positive integer")
        if self.schedule_conservativeness <= 0:
            bad("schedule-conservativeness", self.schedule_conservativeness, "use a positive number (1.0: default)")
        if self.stream_interval < 1:
            bad("stream-interval", self.stream_interval, "use a positive integer")
        if not self.max_request_body_mb > 0:
            bad("max-request-body-mb", self.max_request_body_mb, "use a positive size in MiB")
        if self.max_n < 1:
            bad("max-n", self.max_n, "use a positive integer")
        if not self.watchdog_timeout > 0:
            bad("watchdog-timeout", self.watchdog_timeout, "use a positive number of seconds")

    def _check_dp(self, bad) -> None:
        """Validate ``--dp-size``, ``--enable-dp-attention`` and ``--load-balance-method`` (``bad(flag, value, fix)``
        raises). DP attention needs ``--dp-size`` equal to ``--tp-size`` (SGLang's rule: one attention replica per
        rank); plain data parallelism over full replicas is not built here (several servers behind a router are). The
        combinations with other techniques are refused by ``sglang.srt.dp_attention.deploy.validate``."""
        if self.load_balance_method not in ("round_robin", "shortest_queue"):
            bad("load-balance-method", self.load_balance_method, "use round_robin or shortest_queue")
        if self.dp_size < 1:
            bad("dp-size", self.dp_size, "use a positive integer")
        if self.enable_dp_attention:
            if self.dp_size != self.tp_size:
                bad("dp-size", self.dp_size, f"--enable-dp-attention needs --dp-size equal to --tp-size "
                    f"(--tp-size={self.tp_size}): use --dp-size {self.tp_size} --tp-size {self.tp_size}")
            if self.dp_size < 2:
                bad("enable-dp-attention", True, "DP attention needs --dp-size >= 2 (and --tp-size equal); "
                    "drop --enable-dp-attention for one rank")
        elif self.dp_size > 1:
            bad("dp-size", self.dp_size, "--dp-size > 1 needs --enable-dp-attention (data-parallel attention over the "
                f"--tp-size ranks; --tp-size {self.dp_size} --dp-size {self.dp_size} --enable-dp-attention); for "
                "independent replicas run several servers behind python -m sglang.srt.disaggregation.mini_lb --workers")

    def _check_disaggregation(self, bad) -> None:
        """Validate the ``--disaggregation-*`` flags (``bad(flag, value, fix)`` raises)."""
        if self.disaggregation_mode not in ("null", "prefill", "decode"):
            bad("disaggregation-mode", self.disaggregation_mode, "use null, prefill or decode")
        if self.disaggregation_transfer_backend not in ("nixl", "fake"):
            bad("disaggregation-transfer-backend", self.disaggregation_transfer_backend, "use nixl or fake")
        if self.disaggregation_transfer_mode not in ("pull", "push"):
            bad("disaggregation-transfer-mode", self.disaggregation_transfer_mode, "use pull or push")
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            bad("disaggregation-bootstrap-port", self.disaggregation_bootstrap_port, "use a TCP port in 1..65535")
        for name in ("disaggregation_bootstrap_timeout", "disaggregation_transfer_timeout",
                     "disaggregation_heartbeat_interval", "disaggregation_heartbeat_timeout"):
            if getattr(self, name) <= 0:
                bad(name.replace("_", "-"), getattr(self, name), "use a positive number of seconds")
        if self.disaggregation_nixl_threads < 0:
            bad("disaggregation-nixl-threads", self.disaggregation_nixl_threads, "use 0 (off) or a thread count")
        if self.disaggregation_push_wait_timeout < 0:
            bad("disaggregation-push-wait-timeout", self.disaggregation_push_wait_timeout,
                "use a number of seconds >= 0 (0: prefill push-mode requests without waiting)")
        if self.kv_cache_layout not in ("auto", "layer_major", "token_major"):
            bad("kv-cache-layout", self.kv_cache_layout,
                "use auto (token_major for pull-mode PD, else layer_major), layer_major or token_major")
        if self.disaggregation_mode != "null" and self.enable_overlap_schedule:
            bad("enable-overlap-schedule", True, "overlap scheduling is not supported with --disaggregation-mode yet")

    def _check_afd(self, bad) -> None:
        """Validate the ``--afd-*`` flags and set what AFD needs (no CUDA graphs: the executor dispatches remotely;
        prefill chunks that fit one micro-batch)."""
        for name in ("afd_attention_workers", "afd_ffn_workers", "afd_micro_batches", "afd_max_tokens"):
            if getattr(self, name) < 1:
                bad(name.replace("_", "-"), getattr(self, name), "use a positive integer")
        if self.afd_transport not in ("auto", "inline", "cuda_ipc", "cuda_push", "cuda_push_ll", "nccl", "nixl"):
            bad("afd-transport", self.afd_transport,
                "use auto, inline, cuda_ipc, cuda_push, cuda_push_ll, nccl or nixl")
        if self.afd_transport == "nixl":
            from sglang.srt.disaggregation.transfer.base import nixl_available

            ok, why = nixl_available()
            if not ok:
                bad("afd-transport", self.afd_transport, f"nixl does not import ({why}); pip install 'sglang[pd]'")
        if self.afd_timeout_s <= 0:
            bad("afd-timeout-s", self.afd_timeout_s, "use a positive number of seconds")
        if self.afd_redundant_experts < 0 or self.afd_rebalance_interval < 0:
            bad("afd-redundant-experts", self.afd_redundant_experts, "use counts >= 0")
        if self.afd_rebalance_interval and self.afd_attention_workers > 1:
            bad("afd-rebalance-interval", self.afd_rebalance_interval,
                "live expert rebalancing needs --afd-attention-workers 1 (one placement owner); use 0")
        if self.nnodes > 1:
            bad("nnodes", self.nnodes, "--enable-afd runs on one node here (multi-node placement comes with --use-ray)")
        if self.enable_tokenweave:
            bad("enable-tokenweave", True,
                "--enable-tokenweave and --enable-afd cannot be combined (TokenWeave and AFD executors); drop one")
        object.__setattr__(self, "disable_cuda_graph", True)
        if self.chunked_prefill_size is None or self.chunked_prefill_size > self.afd_max_tokens // 2:
            object.__setattr__(self, "chunked_prefill_size", max(1, self.afd_max_tokens // 2))
        if self.max_running_requests is None or self.max_running_requests > self.afd_max_tokens // 2:
            object.__setattr__(self, "max_running_requests", max(1, self.afd_max_tokens // 2))

    # ---- derived settings -------------------------------------------------
    def ray_extra_resources(self) -> dict:
        """``--ray-worker-resources`` parsed: ``{name: amount}`` (empty when unset).

        Raises:
            ValueError: not a JSON object of non-negative numbers, or it names CPU/GPU (use
                --ray-cpus-per-worker / --ray-gpus-per-worker).
        """
        import json

        if not self.ray_worker_resources:
            return {}
        fix = "use a JSON object of custom Ray resources, e.g. '{\"node_a\": 0.01}'"
        try:
            res = json.loads(self.ray_worker_resources)
        except json.JSONDecodeError:
            raise ValueError(f"--ray-worker-resources={self.ray_worker_resources!r} is invalid: {fix}") from None
        if not isinstance(res, dict) or not all(isinstance(v, (int, float)) and v >= 0 for v in res.values()):
            raise ValueError(f"--ray-worker-resources={self.ray_worker_resources!r} is invalid: {fix}")
        if {"CPU", "GPU"} & set(res):
            raise ValueError(f"--ray-worker-resources={self.ray_worker_resources!r} is invalid: set CPU/GPU with "
                             f"--ray-cpus-per-worker / --ray-gpus-per-worker")
        return {k: float(v) for k, v in res.items()}

    @property
    def resolved_device(self) -> str:
        """``cpu`` or ``cuda``: ``auto`` picks cuda when a GPU is visible."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_kv_cache_layout(self) -> str:
        """The KV pool's storage order (the one place it is chosen; both PD sides compute it alike):
        ``--kv-cache-layout``, or for ``auto`` ``token_major`` when this is a prefill or decode server in pull mode
        (the decode side reads a request's run of slots as ONE range across all layers: one transfer descriptor
        per slot run instead of 2 x layers, KVDirect sec. 4.2), else ``layer_major`` (aggregated
        serving; push mode, whose layerwise WRITEs want one contiguous range per layer). Sides with different
        layouts still move the right bytes (more descriptors). See
        :class:`~sglang.srt.mem_cache.memory_pool.MHATokenToKVPool`."""
        if self.kv_cache_layout != "auto":
            return self.kv_cache_layout
        pd_pull = self.disaggregation_mode in ("prefill", "decode") and self.disaggregation_transfer_mode == "pull"
        return "token_major" if pd_pull else "layer_major"

    @property
    def resolved_tokenweave_sharded_residual(self) -> bool:
        """Whether TokenWeave's split forwards keep the residual sharded (TokenWeave, Gond et al. 2025, sec. 3-4):
        ``--enable-tokenweave`` and not ``--tokenweave-full-residual`` (the sharded residual is the default)."""
        return self.enable_tokenweave and self.tokenweave_sharded_residual is not False

    @property
    def resolved_enable_mixed_chunk(self) -> bool:
        """Whether a step runs prefill chunks together with the running requests' decode tokens (MIXED batches):
        ``--enable-mixed-chunk`` on, ``--disable-mixed-chunk`` off (SGLang's default: a prefill batch runs alone);
        neither: on (this server's behaviour so far, kept until measurements decide the default)."""
        return self.enable_mixed_chunk is not False

    @property
    def resolved_tokenizer_path(self) -> str:
        """``tokenizer_path``, or ``model_path`` when unset."""
        return self.tokenizer_path or self.model_path

    @property
    def resolved_attention_backend(self) -> str:
        """``--attention-backend``, or the default: ``triton`` when the resolved device is cuda and
        ``triton`` imports, else ``torch_native``."""
        if self.attention_backend:
            return self.attention_backend
        if self.resolved_device == "cuda":
            try:
                import triton  # noqa: F401
            except ImportError:
                return "torch_native"
            return "triton"
        return "torch_native"

    @property
    def model_name(self) -> str:
        """Name reported by ``/v1/models`` and accepted as the OpenAI ``model`` field."""
        return self.served_model_name or self.model_path

    def url(self) -> str:
        """Base URL of the HTTP server, ``http://<host>:<port>``."""
        return f"http://{self.host}:{self.port}"

    def replace(self, **changes) -> "ServerArgs":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ---- CLI --------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add every field as ``--flag-name`` (booleans as store_true; an ``Optional[bool]`` field as a pair of
        mutually exclusive flags, ``--flag-name`` storing True and its :data:`FALSE_FLAGS` entry storing False, both
        defaulting to None: "not given")."""
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if str(f.type) == "Optional[bool]":
                group = parser.add_mutually_exclusive_group()
                group.add_argument(flag, dest=f.name, action="store_const", const=True, default=default,
                                   help=SERVER_ARGS_HELP.get(f.name))
                off = FALSE_FLAGS[f.name]
                group.add_argument(off, dest=f.name, action="store_const", const=False, default=default,
                                   help=SERVER_ARGS_HELP.get(off[2:].replace("-", "_")))
                continue
            if f.type in ("bool",) or isinstance(default, bool):
                parser.add_argument(flag, action="store_true", default=default,
                                    help=SERVER_ARGS_HELP.get(f.name))
                continue
            typ = {"int": int, "float": float, "Optional[int]": int, "Optional[float]": float}.get(str(f.type), str)
            parser.add_argument(flag, type=typ, default=default, help=SERVER_ARGS_HELP.get(f.name))
        parser.add_argument("--tp", dest="tp_size", type=int, default=1, help="Alias of --tp-size.")
        parser.add_argument("--data-parallel-size", dest="dp_size", type=int, default=1, help="Alias of --dp-size.")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        """ServerArgs from a parsed namespace (attributes that are not fields are ignored); validated like the
        constructor."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def prepare_launch_args(argv: list[str]) -> tuple[ServerArgs, bool]:
    """Parse a launch_server command line into :class:`ServerArgs` and whether ``--dry-run`` was given."""
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--dry-run", action="store_true", default=False,
                        help="Print the deployment plan (every process: role, ranks, node, device, executor, "
                        "communicator, connector) and exit without starting anything.")
    ns = parser.parse_args(argv)
    return ServerArgs.from_cli_args(ns), ns.dry_run


def prepare_server_args(argv: list[str]) -> ServerArgs:
    """Parse a launch_server command line into :class:`ServerArgs` (``--dry-run`` is accepted and ignored)."""
    return prepare_launch_args(argv)[0]


@dataclass(frozen=True)
class PortArgs:
    """ZMQ endpoints between the processes (IPC sockets in a private temp dir).

    ``tokenizer_ipc``: bound (PULL) by the TokenizerManager; the detokenizer
    and scheduler push to it. ``scheduler_input_ipc``: bound (PULL) by the
    scheduler. ``detokenizer_ipc``: bound (PULL) by the detokenizer.
    """

    tokenizer_ipc: str
    scheduler_input_ipc: str
    detokenizer_ipc: str
    ipc_dir: str = field(default="")
    # data-parallel schedulers (AFD attention workers, DP-attention ranks): scheduler a binds dp_scheduler_inputs[a]
    dp_scheduler_inputs: tuple = ()
    # DP attention: the data-parallel schedulers step together, so a request sent to one wakes the others
    dp_wake_peers: bool = False

    @classmethod
    def init_new(cls, transport: str = "ipc", host: str = "127.0.0.1") -> "PortArgs":
        """Fresh endpoints: ``transport="ipc"``: ``ipc://<private temp dir>/{tokenizer,scheduler,detokenizer}``;
        ``"tcp"``: ``tcp://<host>:<free port>`` each (a worker on another host connects to them).

        Raises:
            ValueError: an unknown transport.
        """
        if transport == "tcp":
            from sglang.srt.utils.common import free_tcp_ports

            a, b, c = free_tcp_ports(3, host)
            return cls(tokenizer_ipc=f"tcp://{host}:{a}", scheduler_input_ipc=f"tcp://{host}:{b}",
                       detokenizer_ipc=f"tcp://{host}:{c}")
        if transport != "ipc":
            raise ValueError(f"zmq transport {transport!r} must be 'ipc' or 'tcp'")
        from sglang.srt.utils.ipc_dirs import make_ipc_dir

        d = make_ipc_dir()  # also removes the folders of servers that died without cleaning up
        return cls(
            tokenizer_ipc=f"ipc://{os.path.join(d, 'tokenizer')}",
            scheduler_input_ipc=f"ipc://{os.path.join(d, 'scheduler')}",
            detokenizer_ipc=f"ipc://{os.path.join(d, 'detokenizer')}",
            ipc_dir=d,
        )
