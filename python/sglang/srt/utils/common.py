"""Helpers shared by the server's processes."""

from __future__ import annotations

import logging
import os
import signal
from typing import Optional

import zmq

logger = logging.getLogger(__name__)


def configure_logger(log_level: str = "info", prefix: str = "") -> None:
    """Configure root logging for one process; ``prefix`` names it (e.g. ``"TP0"``).

    Logs carry the process role so multi-process (and later multi-rank)
    output can be told apart.
    """
    fmt = f"[%(asctime)s{' ' + prefix if prefix else ''}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format=fmt,
                        datefmt="%Y-%m-%d %H:%M:%S", force=True)


def get_zmq_socket(context: zmq.Context, socket_type: int, endpoint: str, bind: bool) -> zmq.Socket:
    """Create a ZMQ socket (PUSH/PULL/...) bound to or connected to ``endpoint``.

    High-water marks are disabled so bursts of requests are never dropped.
    """
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def free_tcp_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago (bound together, then released)."""
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def get_tokenizer(path: str, trust_remote_code: bool = False):
    """Load a HF tokenizer from a local folder (no hub access is attempted).

    Raises:
        ValueError: the folder holds no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # transformers raises many types here
        raise ValueError(
            f"cannot load a tokenizer from {path!r} ({type(e).__name__}: {e}); "
            "pass --tokenizer-path with a folder holding tokenizer.json or tokenizer.model"
        ) from e
    return tok


def kill_process_tree(pid: Optional[int] = None, include_parent: bool = True, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to every descendant of ``pid`` (default: this process), then to ``pid``."""
    import psutil

    pid = os.getpid() if pid is None else pid
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for child in parent.children(recursive=True):
        try:
            child.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    if include_parent:
        try:
            parent.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
