"""``launch_server --help`` texts, the one source of them: SGLang's help text for each flag (its wording where the
flag is SGLang's), this fork's where the flag is its own. ``--help`` prints each with its default."""

from __future__ import annotations

SERVER_ARGS_HELP: dict[str, str] = {
    # model and tokenizer
    "model_path": "HF checkpoint folder, or an embedded model: 'sglang-tw/stories260K' (the default: the trained "
    "260K-parameter TinyStories Llama, shipped with the package) or 'sglang-tw/tiny-random-llama' (random weights; its "
    "text is not meaningful).",
    "tokenizer_path": "The path of the tokenizer (default: --model-path).",
    "served_model_name": "Override the model name returned by the v1/models endpoint in OpenAI API server.",
    "load_format": "auto|safetensors|dummy (dummy: random weights of the config's shape).",
    "quantization": "The quantization method: fp8 (FP8 e4m3 weights quantized at load, one scale per output channel, "
    "dynamic per-token activation scales; embeddings and the LM head stay in --dtype). An FP8 checkpoint "
    "(quantization_config with quant_method fp8 in its config.json) is detected and loaded as published without it.",
    "dtype": "Data type for model weights and activations: auto (FP16 for FP32/FP16 models, BF16 for BF16 models) "
    "| float32 | float16 | bfloat16.",
    "kv_cache_dtype": "Data type for kv cache storage. \"auto\" will use model data type. \"bf16\" or \"bfloat16\" "
    "for BF16 KV cache. \"fp8_e5m2\" and \"fp8_e4m3\" store K and V in FP8 with per-layer scales (the checkpoint's "
    "k_scale/v_scale, else 1.0), twice the tokens of a BF16 cache in the same memory. SGLang's mxfp8 / nvfp4 / fp4 "
    "formats are not supported here.",
    "device": "The device to use: auto | cpu | cuda (auto picks cuda when a GPU is visible).",
    "context_length": "The model's maximum context length. Defaults to None (will use the value from the model's "
    "config.json instead).",
    "trust_remote_code": "Whether or not to allow for custom models defined on the Hub in their own modeling files.",
    "skip_tokenizer_init": "If set, skip init tokenizer and pass input_ids in generate request.",
    "chat_template": "The builtin chat template name or the path of the chat template file. This is only used for "
    "OpenAI-compatible API server.",
    # HTTP
    "host": "The host of the HTTP server.",
    "port": "The port of the HTTP server.",
    "api_key": "Set API key of the server. It is also used in the OpenAI API compatible server.",
    "enable_metrics": "Enable log prometheus metrics.",
    "max_request_body_mb": "Largest HTTP request body in MiB; larger requests get HTTP 413.",
    "max_n": "Most samples per prompt (the request's n); larger n gets HTTP 400 (OpenAI's limit is 128).",
    # memory and scheduling
    "mem_fraction_static": "Fraction of GPU memory for weights + KV cache (GPU only).",
    "max_total_tokens": "KV cache size in tokens (overrides the memory-based size).",
    "max_running_requests": "The maximum number of running requests.",
    "max_prefill_tokens": "The maximum number of tokens in a prefill batch. The real bound will be the maximum of "
    "this value and the model's maximum context length.",
    "chunked_prefill_size": "Max prompt tokens per prefill chunk; -1 disables chunking.",
    "enable_mixed_chunk": "Enabling mixing prefill and decode in a batch when using chunked prefill (the default "
    "when neither this flag nor --disable-mixed-chunk is given).",
    "disable_mixed_chunk": "Run each prefill batch alone and the running requests' decode steps separately "
    "(SGLang's default scheduling).",
    "schedule_policy": "The scheduling policy of the requests: fcfs | lpm (longest prefix match).",
    "schedule_conservativeness": "How conservative the schedule policy is. A larger value means more conservative "
    "scheduling. Use a larger value if you see requests being retracted frequently.",
    "disable_radix_cache": "Disable RadixAttention for prefix caching.",
    "page_size": "The number of tokens in a page.",
    "attention_backend": "Choose the kernels for attention layers: torch_native | triton | flashinfer "
    "(default: triton on CUDA, torch_native on CPU). flashinfer needs the optional FlashInfer package "
    '(pip install "sglang[flashinfer]"); without it the flag is refused at start.',
    "incremental_streaming_output": "Streamed /generate chunks carry only what is new: text, output_ids and the "
    "output-token logprob lists (one entry per token of the chunk), the prompt's logprobs once. Off (SGLang's "
    "default): every chunk is cumulative.",
    "stream_interval": "The interval (or buffer size) for streaming in terms of the token length. A smaller value "
    "makes streaming smoother, while a larger value makes the throughput higher.",
    "grammar_backend": "Choose the backend for grammar-guided decoding: xgrammar | none.",
    "constrained_json_disable_any_whitespace": "Whether to disable any whitespace in JSON constrained output "
    "(compact separators only).",
    "cuda_graph_max_bs": "Set the maximum batch size for cuda graph. It will extend the cuda graph capture batch "
    "size to this value.",
    "disable_cuda_graph": "Disable cuda graph.",
    "disable_overlap_schedule": "Disable the overlap scheduler, which overlaps the CPU scheduler with GPU model "
    "worker.",
    "enable_overlap_schedule": "Force the overlap scheduler on CPU (it is on by default on CUDA).",
    # parallelism
    "tp_size": "The tensor parallelism size.",
    "ep_size": "The expert parallelism size.",
    "dp_size": "The data parallelism size (with --enable-dp-attention: the DP attention ranks, equal to --tp-size).",
    "enable_dp_attention": "Enabling data parallelism for attention and tensor parallelism for FFN. The dp size should "
    "be equal to the tp size. Each DP rank schedules its own requests with its own KV cache; MoE layers run expert "
    "parallel over all ranks (see docs/expert_parallel.md).",
    "load_balance_method": "The load balancing strategy for data parallelism: shortest_queue (the rank with the fewest "
    "unfinished requests, ties in turn) | round_robin.",
    "moe_a2a_backend": "Choose the backend for MoE A2A (expert parallelism by all-to-all): none (default: every "
    "rank runs every token and an all-reduce sums the expert outputs) | nccl (torch.distributed all-to-all; gloo on "
    "CPU) | tdist (Triton-distributed low-latency all-to-all; on CPU only under TRITON_INTERPRET=1). Needs "
    "--ep-size equal to --tp-size; normal mode for prefill, low-latency (CUDA-graph capturable) for decode. With "
    "--enable-dp-attention each DP rank dispatches its own requests' tokens. deepep is not available here.",
    "nnodes": "The number of nodes.",
    "node_rank": "The node rank.",
    "dist_init_addr": "The host address for initializing distributed backend (e.g., `192.168.0.2:25000`).",
    "dist_timeout": "Set timeout for torch.distributed initialization (seconds; default 1800).",
    "disable_custom_all_reduce": "Disable the custom all-reduce kernel and fall back to NCCL.",
    "comm_backend": "Collective backend of tensor parallelism: auto | torch | custom | tw | nocomm (benchmarks "
    "only) | module:factory.",
    "base_gpu_id": "The first GPU index this node's workers use (worker i gets base + i * step).",
    "gpu_id_step": "The GPU index step between consecutive workers on a node.",
    "zmq_transport": "ipc|tcp: transport of the sockets between the server's processes (tcp on 127.0.0.1 ports, so a "
    "worker can live on another host).",
    "enable_tokenweave": "TokenWeave: split large batches into two wave-aware token halves and overlap one half's "
    "fused AllReduce + RMSNorm with the other half's compute (TP > 1; --comm-backend tw by default).",
    "tokenweave_min_tokens": "Batches with fewer new tokens (and decode batches) run unsplit (default: auto, the "
    "measured break-even per GPU and TP size: off at TP2 on H100, where it lost at every size measured; 8192 at TP4; "
    "1024 otherwise).",
    "tokenweave_comm_sms": "SM budget of TokenWeave's overlapped communication kernel (default: tw-comm's, 16); "
    "split forwards cap their cuBLAS GEMMs to the GPU's SMs minus this many, so the kernel runs beside them.",
    "tokenweave_sharded_residual": "The default with --enable-tokenweave (this flag only makes it explicit): "
    "TokenWeave's split forwards keep the residual sharded (each TP rank updates only its 1/TP of each split's "
    "residual rows and all-gathers only the normed rows, TokenWeave sec. 3-4), about 30%% less communication than the "
    "full residual; same tokens. CUDA-graphed 4-layer Llama-3.3-70B TP4 on 4 x H200: 0.92-0.98x the full residual's "
    "time at 1K-8K tokens (benchmark/results/archive/tokenweave/2026-11-27_sharded_residual_and_e2e_4xh200.md).",
    "tokenweave_full_residual": "TokenWeave's split forwards keep the full residual on every TP rank (each fused "
    "AllReduce + add + RMSNorm all-gathers the residual rows too) instead of the default sharded residual.",
    "enable_two_batch_overlap": "Two-batch overlap (SGLang's flag): split each large enough batch into two "
    "micro-batches (by requests in decode, by tokens in prefill) and interleave their layer stages so that one "
    "micro-batch's MoE dispatch/combine (or the TP / all-reduce-EP all-reduce) runs on a communication stream while the "
    "other computes. Off by itself for batches below --tbo-min-tokens. See docs/expert_parallel.md.",
    "tbo_token_distribution_threshold": "Two-batch overlap (SGLang's flag and default): when the most balanced cut "
    "between requests leaves one micro-batch less than this fraction of the tokens, cut at half the tokens instead (one "
    "request then straddles the micro-batches). In [0, 0.5]; 0 never cuts inside a request.",
    "tbo_min_tokens": "Two-batch overlap: batches with fewer new tokens on this rank run unsplit (default: auto, the "
    "table per GPU and EP size in sglang/srt/two_batch_overlap/auto_off.py: off at EP 1 and on CPU, where nothing "
    "overlaps; provisional, unmeasured values at EP >= 2). 2 forces the overlap on for every batch that can be split.",
    "tp_ranks_share_gpu": "Correctness test mode: all TP ranks run on --base-gpu-id as separate processes (device "
    "group over gloo, tw-comm over CUDA IPC within the GPU; CUDA graphs and custom all-reduce off). Never for speed.",
    "enable_tdist_overlap": "Triton-distributed: keep the residual token-sharded across TP ranks (sequence parallel) "
    "and run column/row-parallel linears as fused AllGather-GEMM / GEMM-ReduceScatter on a CUDA-IPC symmetric heap (no "
    "multicast); the torch collectives on CPU. Dense decoders only. See docs/tdist.md.",
    "tdist_overlap_min_tokens": "With --enable-tdist-overlap, batches with fewer tokens run the plain sequential "
    "executor (all-reduce) instead of the sequence-parallel layout (default: auto, the smallest batch at which the "
    "GPU model's calibration table sends >= 75 percent of the layer's GEMM work to the overlapped decomposition: 8192 "
    "at TP4 on H200; at least 8192 on GPUs without a table; never with torch collectives). 0: the layout for every "
    "batch.",
    "enable_custom_logit_processor": "Accept the custom_logit_processor request field. SECURITY: it is client-supplied "
    "code (a dill-serialized Python class) that the scheduler deserializes and runs; enable only when every client is "
    "trusted. Off: such requests get a 400. Needs the dill package (pip install 'sglang[custom-logit-processor]').",
    "use_ray": "Start every worker (TP ranks, detokenizer) as a Ray actor placed by placement groups (pip install "
    "'sglang[ray]'); --nnodes N spreads the TP group over N nodes.",
    "ray_address": "Ray cluster to join with --use-ray (default auto: the running cluster).",
    "ray_spread_roles": "Put every role group in one STRICT_SPREAD placement group (roles on distinct nodes).",
    "ray_cpus_per_worker": "Ray CPUs each worker reserves.",
    "ray_gpus_per_worker": "Ray GPUs each worker reserves on CUDA (default 1; a fraction lets ranks share a GPU, for "
    "--tp-ranks-share-gpu tests only).",
    "ray_worker_resources": "JSON dict of custom Ray resources each worker also reserves, e.g. '{\"node_a\": 0.01}' to "
    "pin this instance (say a prefill server) to nodes started with --resources '{\"node_a\": 1}'.",
    "ray_placement_timeout": "Seconds to wait for Ray to place the workers before failing.",
    # disaggregation (KVDirect) and attention/FFN disaggregation (MegaScale-Infer)
    "disaggregation_bootstrap_timeout": "Seconds a decode request waits for its prefill peer (connect + KV ready) "
    "before it fails.",
    "disaggregation_transfer_timeout": "Seconds one posted KV transfer may take before the request fails.",
    "disaggregation_nixl_threads": "nixl backend: dedicated UCX transfer threads (each its own UCX worker; between GPUs "
    "of one host, its own CUDA streams); a transfer of >= 8 descriptors is split over them. 0: NIXL's default "
    "(the KV of one request moves as one request of one worker). Experimental: on 4 x H200 (nixl-cu13 1.5.1) a "
    "1-descriptor GPU READ never completed with 4 (bench_nixl_read threads4); a stuck transfer fails after "
    "--disaggregation-transfer-timeout.",
    "disaggregation_heartbeat_interval": "Seconds between heartbeats to peers with open transfers.",
    "disaggregation_heartbeat_timeout": "Seconds of peer silence after which its transfers fail and their KV is freed.",
    "disaggregation_push_wait_timeout": "Push mode, prefill side: seconds a request waits for the decode side's "
    "preallocated KV slots before it prefills anyway (with them, each layer's KV is written during the forward; "
    "without, after it). 0: never wait.",
    "afd_max_tokens": "Most tokens of one AFD micro-batch (sizes the M2N registered buffers).",
    "afd_timeout_s": "Seconds an FFN worker may take to answer; later fails the batch (never a hang).",
    "afd_redundant_experts": "Replicas of hot experts the expert load balancer may add across the FFN workers.",
    "afd_rebalance_interval": "Decode steps between expert placement updates (0: static placement).",
    "disaggregation_mode": "null|prefill|decode: run as an aggregated server, a prefill server (computes the prompt's "
    "KV and the first token, serves them to decode servers) or a decode server (pulls the KV and decodes). Put python "
    "-m sglang.srt.disaggregation.mini_lb in front.",
    "disaggregation_bootstrap_port": "Prefill servers: HTTP port of the bootstrap server where decode ranks fetch the "
    "prefill ranks' transfer metadata and KV descriptors.",
    "disaggregation_transfer_backend": "nixl|fake: the one-sided KV transport (fake: in-host test transport).",
    "disaggregation_transfer_mode": "pull (decode reads the KV once the prefill is done; KVDirect) or push (prefill "
    "writes into blocks the decode side preallocated). Both sides must agree.",
    "kv_cache_layout": "auto|layer_major|token_major: storage order of the KV cache. layer_major = [layer, K/V, "
    "slot, head, head_dim] (one range per layer: aggregated serving, push-mode layerwise WRITEs); token_major = "
    "[slot, layer, K/V, head, head_dim] (a run of slots is one range across all layers: one transfer descriptor per "
    "slot run instead of 2 x layers for pull-mode PD). auto: token_major for --disaggregation-mode prefill/decode "
    "with --disaggregation-transfer-mode pull, else layer_major. Sides with different layouts still work.",
    "disaggregation_verify": "Checksum every transferred request's KV per (layer, K/V, head) on both sides; a mismatch "
    "fails the request.",
    "enable_afd": "MegaScale-Infer attention/FFN disaggregation for MoE models: attention workers (attention, dense "
    "parts, KV) and FFN workers (routed experts) in separate processes, a ping-pong pipeline over --afd-micro-batches, "
    "M2N transfers (docs/afd.md).",
    "afd_attention_workers": "Attention workers N_A (data parallel; each runs --tp ranks and its own requests).",
    "afd_ffn_workers": "FFN workers N_E (expert parallel over the routed experts).",
    "afd_micro_batches": "m: request micro-batches of the ping-pong pipeline (hides transfers when m >= 2(1+Tc/Tf), "
    "logged).",
    "afd_transport": "M2N payload transport: inline (CPU, ZMQ), cuda_ipc (same-node GPUs, host-driven), cuda_push "
    "(same-node GPUs, device-driven: payload + flag), cuda_push_ll (cuda_push with the low-latency protocol: each "
    "4-byte word travels with its tag in one 8-byte word, no flag or fence; 2x the wire bytes), nccl (baseline), nixl "
    "(one-sided NIXL READ over UCX/RDMA, across nodes; needs pip install 'sglang[pd]'); auto = inline on CPU; on GPU "
    "cuda_ipc when every worker is on one node, nccl otherwise.",
    # misc
    "random_seed": "The random seed.",
    "watchdog_timeout": "Set watchdog timeout in seconds. If a forward batch takes longer than this, the server "
    "will crash to prevent hanging.",
    "log_level": "The logging level of all loggers.",
    "decode_log_interval": "The log interval of decode batch.",
    "log_requests": "Log metadata, inputs, outputs of all requests.",
}
