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


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for automatically assigned ports (``connect()`` and ``bind(port 0)``), Linux default
    32768-60999."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_tcp_ports(n: int, host: str = "127.0.0.1", low: int = 20000) -> list[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago (bound together, then released).

    The ports come from ``low`` up to just below the kernel's ephemeral range (20000-32767 by default; above Ray's
    worker ports 10002-19999), where no ``connect()`` and no ``bind(0)`` of another process can take them while our
    process that is to bind them starts. A port picked at random is tried up to 64 times per port before falling back
    to a kernel-assigned one.
    """
    import random
    import socket

    lo_eph, _ = _ephemeral_range()
    high = lo_eph - 1 if lo_eph - 1 > low + 1000 else None
    socks = []
    try:
        while len(socks) < n:
            s = socket.socket()
            for _ in range(64 if high else 0):
                try:
                    s.bind((host, random.randint(low, high)))
                    break
                except OSError:
                    continue
            else:
                s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def bind_zmq_tcp(context: zmq.Context, socket_type: int, host: str) -> tuple[zmq.Socket, str]:
    """A ZMQ socket bound now to a free TCP port on ``host``, and its endpoint ``tcp://host:port``.

    For an endpoint that other processes connect to later (the TokenizerManager's inbox under ``--use-ray``): binding
    before they start leaves no window in which another process can take the port (a port probed and released
    earlier can be taken by then: ``zmq.error.ZMQError: Address already in use``). Same socket options as
    :func:`get_zmq_socket`.
    """
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    port = free_tcp_ports(1, host)[0]
    try:
        sock.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError:  # taken in between: let the kernel pick one
        port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{host}:{port}"


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
