"""Checks the launcher runs before anything heavy starts, so a new user's first mistakes fail in about a second
with one line that names the flag and the fix (instead of after the model loaded, or as a traceback).

* :func:`check_port_free`: ``--host:--port`` can be bound (it was found busy only after the model loaded);
* :func:`check_model_path`: ``--model-path`` (and ``--tokenizer-path``) is a local HF checkpoint folder
  (it was found wrong inside the scheduler process, 8-17 s later);
* :func:`check_device`: ``--device cuda`` has a usable GPU (it ended in a 35-line traceback);
* :func:`check_kv_cache`: an FP8 KV cache's checkpoint scales are well formed and E4M3 runs on this GPU.
"""

from __future__ import annotations

import errno
import os
import socket

from sglang.srt.server_args import EMBEDDED_MODELS, ServerArgs


def check_port_free(host: str, port: int) -> None:
    """Raise if ``host:port`` cannot be bound for the HTTP server.

    Raises:
        ValueError: the port is in use, or the host is not an address of this machine (naming ``--port``/``--host``).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"--host={host!r} cannot be resolved ({e}); use an address of this machine") from None
    family, type_, proto, _, addr = infos[0]
    with socket.socket(family, type_, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is not "in use"
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"--port={port} is already in use on {host} (another server?); stop it or choose "
                                 "another port with --port") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"--host={host!r} is not an address of this machine; use 127.0.0.1, 0.0.0.0 or "
                                 "one of its interfaces") from None
            # anything else (e.g. a privileged port without the right): uvicorn reports it when it binds


def check_model_path(server_args: ServerArgs) -> None:
    """Raise unless ``--model-path`` is an embedded model's name or a folder holding ``config.json``
    (this server loads local checkpoints only); likewise a given ``--tokenizer-path`` must be a folder.

    Raises:
        ValueError: naming the flag, the path and what is missing.
    """
    path = server_args.model_path
    if path not in EMBEDDED_MODELS:
        if not os.path.exists(path):
            raise ValueError(f"--model-path={path!r} does not exist; pass a local HF checkpoint folder (this server "
                             "does not download models), or omit it to serve the embedded default model")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--model-path={path!r} has no config.json; pass a HF checkpoint folder "
                             "(config.json, *.safetensors, tokenizer files)")
    tok = server_args.tokenizer_path
    if tok and not server_args.skip_tokenizer_init and not os.path.isdir(tok):
        raise ValueError(f"--tokenizer-path={tok!r} is not a folder; pass a folder with tokenizer.json or "
                         "tokenizer.model")


def check_device(server_args: ServerArgs) -> None:
    """Raise if ``--device cuda`` was asked for and no CUDA GPU is usable.

    Raises:
        ValueError: one line saying why (torch built without CUDA, or no GPU visible) and the fix.
    """
    if server_args.device != "cuda":
        return
    import torch

    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) was built without CUDA"
    elif not torch.cuda.is_available():
        why = "no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)"
    else:
        return
    raise ValueError(f"--device=cuda is unusable: {why}; use --device cpu (or auto, which picks the GPU when "
                     "there is one)")


def check_kv_cache(server_args: ServerArgs) -> None:
    """For an FP8 ``--kv-cache-dtype``: the checkpoint's KV scales are well formed (read from a local checkpoint's
    safetensors headers, :func:`~sglang.srt.model_loader.kv_scales.read_kv_scales`), and ``fp8_e4m3`` does not run
    the Triton or FlashInfer backend on a CUDA GPU older than sm_89 (both store K/V through the fused Triton RoPE +
    KV-store kernel, and Triton converts to E4M3 only on Ada / Hopper and newer; E5M2 works from sm_80).

    Raises:
        ValueError: naming the malformed scale tensor and its file, or the GPU's compute capability and the
            alternatives.
    """
    if server_args.kv_cache_dtype not in ("fp8_e4m3", "fp8_e5m2"):
        return
    path = server_args.model_path
    if server_args.load_format != "dummy" and os.path.isfile(os.path.join(path, "config.json")):
        import json

        from sglang.srt.model_loader.kv_scales import read_kv_scales
        from sglang.srt.model_loader.loader import safetensors_files

        with open(os.path.join(path, "config.json")) as f:
            layers = int(json.load(f).get("num_hidden_layers", 0))
        if layers > 0:
            read_kv_scales(safetensors_files(path), layers)
    if server_args.kv_cache_dtype != "fp8_e4m3" or server_args.resolved_device != "cuda" \
            or server_args.resolved_attention_backend not in ("triton", "flashinfer"):
        return
    import torch

    major, minor = torch.cuda.get_device_capability(server_args.base_gpu_id)
    if (major, minor) < (8, 9):
        raise ValueError(f"--kv-cache-dtype=fp8_e4m3 needs a GPU of compute capability >= 8.9 (Ada, Hopper) for the "
                         f"Triton KV-store and attention kernels; GPU {server_args.base_gpu_id} is sm_{major}{minor}: use fp8_e5m2 "
                         "or auto")


def preflight(server_args: ServerArgs, serve_http: bool = True) -> None:
    """Every check above (the port only when this node serves HTTP), cheapest first.

    Raises:
        ValueError: the first failed check.
    """
    if serve_http:
        check_port_free(server_args.host, server_args.port)
    check_model_path(server_args)
    check_device(server_args)
    check_kv_cache(server_args)
