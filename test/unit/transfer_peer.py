"""A transfer agent in its own process, driven over a pipe (for the cross-process transfer tests).

``start_peer(backend, name, seed, nbytes)`` spawns a process that registers ``nbytes`` of random host
memory (``numpy`` uint8 from ``seed``; rebuild it with :func:`peer_buffer`) plus a scratch region, publishes
its metadata and serves commands: connect, notifs, send_notif, peek. No torch in the child (fast start).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np


def peer_buffer(seed: int, nbytes: int) -> np.ndarray:
    """The bytes a peer started with ``seed`` registers as its source region."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _main(conn, backend: str, name: str, seed: int, nbytes: int, timeout_s: float) -> None:
    from sglang.srt.disaggregation.transfer import MemRegion, TransferConfig, make_transfer_backend

    agent = make_transfer_backend(backend, name, TransferConfig(transfer_timeout_s=timeout_s))
    src = peer_buffer(seed, nbytes)
    scratch = np.zeros(nbytes, dtype=np.uint8)
    agent.register([MemRegion(src.ctypes.data, nbytes, "cpu"), MemRegion(scratch.ctypes.data, nbytes, "cpu")])
    conn.send((agent.local_metadata(), src.ctypes.data, scratch.ctypes.data))
    while True:
        cmd, *args = conn.recv()
        if cmd == "connect":
            agent.connect(args[0], args[1])
            conn.send(True)
        elif cmd == "notifs":  # wait up to args[0] s for at least args[1] messages
            got: dict[str, list[bytes]] = {}
            end = time.monotonic() + args[0]
            while sum(map(len, got.values())) < args[1] and time.monotonic() < end:
                for k, v in agent.get_notifs().items():
                    got.setdefault(k, []).extend(v)
                time.sleep(0.005)
            conn.send(got)
        elif cmd == "send_notif":
            agent.send_notif(args[0], args[1])
            conn.send(True)
        elif cmd == "peek":  # bytes of the scratch region
            conn.send(bytes(scratch[args[0]:args[0] + args[1]]))
        elif cmd == "exit":
            agent.close()
            conn.send(True)
            return


class Peer:
    """Handle on a spawned agent: ``metadata``, ``src_addr``, ``scratch_addr``, ``call(cmd, *args)``."""

    def __init__(self, backend: str, name: str, seed: int, nbytes: int, timeout_s: float = 5.0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, backend, name, seed, nbytes, timeout_s), daemon=True)
        self.proc.start()
        if not self.conn.poll(180):  # generous: CI machines can be heavily loaded
            self.proc.kill()
            raise RuntimeError(f"transfer peer {name} did not start")
        self.metadata, self.src_addr, self.scratch_addr = self.conn.recv()

    def call(self, cmd: str, *args, timeout: float = 30.0):
        self.conn.send((cmd, *args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd}")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=5)
            except (TimeoutError, OSError, EOFError):
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
