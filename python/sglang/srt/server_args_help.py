"""``launch_server --help`` texts: SGLang's help text for each flag (its wording where the flag is SGLang's),
this fork's where the flag is its own. ``--help`` prints each with its default."""

from __future__ import annotations

SERVER_ARGS_HELP: dict[str, str] = {
    # model and tokenizer
    "model_path": "The path of the model weights. This can be a local folder or a Hugging Face repo ID "
    "(this server loads local folders only).",
    "tokenizer_path": "The path of the tokenizer (default: --model-path).",
    "served_model_name": "Override the model name returned by the v1/models endpoint in OpenAI API server.",
    "load_format": "The format of the model weights to load: auto | safetensors | dummy (dummy: random weights "
    "of the config's shape, mainly for profiling).",
    "dtype": "Data type for model weights and activations: auto (FP16 for FP32/FP16 models, BF16 for BF16 models) "
    "| float32 | float16 | bfloat16.",
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
    "mem_fraction_static": "The fraction of the memory used for static allocation (model weights and KV cache "
    "memory pool). Use a smaller value if you see out-of-memory errors.",
    "max_total_tokens": "The maximum number of tokens in the memory pool. If not specified, it will be "
    "automatically calculated based on the memory usage fraction. This option is typically used for development "
    "and debugging purposes.",
    "max_running_requests": "The maximum number of running requests.",
    "max_prefill_tokens": "The maximum number of tokens in a prefill batch. The real bound will be the maximum of "
    "this value and the model's maximum context length.",
    "chunked_prefill_size": "The maximum number of tokens in a chunk for the chunked prefill. Setting this to -1 "
    "means disabling chunked prefill.",
    "schedule_policy": "The scheduling policy of the requests: fcfs | lpm (longest prefix match).",
    "schedule_conservativeness": "How conservative the schedule policy is. A larger value means more conservative "
    "scheduling. Use a larger value if you see requests being retracted frequently.",
    "disable_radix_cache": "Disable RadixAttention for prefix caching.",
    "page_size": "The number of tokens in a page.",
    "attention_backend": "Choose the kernels for attention layers: torch_native | triton | flashinfer "
    "(default: triton on CUDA, torch_native on CPU).",
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
    "nnodes": "The number of nodes.",
    "node_rank": "The node rank.",
    "dist_init_addr": "The host address for initializing distributed backend (e.g., `192.168.0.2:25000`).",
    "dist_timeout": "Set timeout for torch.distributed initialization (seconds; default 1800).",
    "disable_custom_all_reduce": "Disable the custom all-reduce kernel and fall back to NCCL.",
    "comm_backend": "Collective backend of tensor parallelism: auto | torch | custom | tw | nocomm (benchmarks "
    "only) | module:factory.",
    "base_gpu_id": "The base GPU ID to start allocating GPUs from. Useful when running multiple instances on the "
    "same machine.",
    "gpu_id_step": "The delta between consecutive GPU IDs that are used. For example, setting it to 2 will use "
    "GPU 0,2,4,...",
    "zmq_transport": "ipc | tcp: transport of the sockets between the server's processes.",
    "enable_tokenweave": "TokenWeave: overlap one token split's AllReduce + RMSNorm with the other's compute.",
    "tokenweave_min_tokens": "Batches with fewer new tokens run unsplit (default: auto per TP size).",
    "tokenweave_comm_sms": "SM budget of TokenWeave's overlapped communication kernel.",
    "tp_ranks_share_gpu": "Correctness test mode: all TP ranks on one GPU.",
    # disaggregation (KVDirect) and attention/FFN disaggregation (MegaScale-Infer)
    "disaggregation_bootstrap_timeout": "Seconds a decode request waits for its prefill peer (connect + KV ready) "
    "before it fails.",
    "disaggregation_transfer_timeout": "Seconds one posted KV transfer may take before the request fails.",
    "disaggregation_heartbeat_interval": "Seconds between heartbeats to peers with open transfers.",
    "disaggregation_heartbeat_timeout": "Seconds of peer silence after which its transfers fail and their KV is freed.",
    "disaggregation_push_wait_timeout": "Push mode, prefill side: seconds a request waits for the decode side's "
    "preallocated KV slots before it prefills anyway (with them, each layer's KV is written during the forward; "
    "without, after it). 0: never wait.",
    "afd_max_tokens": "Most tokens of one AFD micro-batch (sizes the M2N registered buffers).",
    "afd_timeout_s": "Seconds an FFN worker may take to answer; later fails the batch (never a hang).",
    "afd_redundant_experts": "Replicas of hot experts the expert load balancer may add across the FFN workers.",
    "afd_rebalance_interval": "Decode steps between expert placement updates (0: static placement).",
    # misc
    "random_seed": "The random seed.",
    "watchdog_timeout": "Set watchdog timeout in seconds. If a forward batch takes longer than this, the server "
    "will crash to prevent hanging.",
    "log_level": "The logging level of all loggers.",
    "log_requests": "Log metadata, inputs, outputs of all requests.",
}
