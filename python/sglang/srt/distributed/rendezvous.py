"""The torch.distributed rendezvous store, listening only on the ``--dist-init-addr`` interface.

``init_process_group(init_method="tcp://HOST:PORT")`` makes rank 0 start a ``TCPStore`` server that listens
on *every* interface (``*:PORT``), unauthenticated, for the whole life of the server: anyone who can reach
the machine could read or write the job's keys. :func:`create_store` binds the listening socket itself to
``HOST`` (127.0.0.1 for one-node runs; node 0's address for multi-node) and hands it to ``TCPStore``
(``master_listen_fd``); the other ranks connect as before.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)


def parse_tcp_init_method(init_method: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` (IPv6 hosts in brackets) -> ``(HOST, PORT)``.

    Raises:
        ValueError: not of that form.
    """
    if not init_method.startswith("tcp://"):
        raise ValueError(f"init method {init_method!r} must be tcp://HOST:PORT")
    host, sep, port = init_method[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"init method {init_method!r} must be tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host:port`` (that interface only).

    Raises:
        RuntimeError: ``host`` is not an address of this machine, or the port is taken (the message says which).
    """
    try:
        family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, type_, proto)
    except OSError as e:
        raise RuntimeError(f"cannot resolve the rendezvous address {host}:{port}: {e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on the rendezvous address {host}:{port} ({e}); on node 0 use one of "
                           "this machine's addresses in --dist-init-addr, and a free port") from e
    return sock


def create_store(init_method: str, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The job's ``TCPStore``: rank 0 serves it on the ``init_method`` interface only; other ranks connect.

    Args:
        init_method: ``tcp://HOST:PORT`` of rank 0.
        rank / world_size: this process's rank in the job and the job size.
        timeout: how long to wait for the store and for keys.
    Raises:
        ValueError: a malformed ``init_method``. RuntimeError: rank 0 cannot listen there.
    """
    host, port = parse_tcp_init_method(init_method)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = bind_listener(host, port)
    fd = sock.detach()  # the store owns the descriptor from now on
    logger.info("rendezvous store listening on %s:%d only", host, port)
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=True, master_listen_fd=fd)
