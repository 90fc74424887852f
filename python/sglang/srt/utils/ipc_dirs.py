"""Private IPC socket folders (``<tmp>/sglang-ipc-*``) and the removal of those left by dead servers.

A server removes its folder when it stops, but a server that was SIGKILLed (or lost power) leaves it
behind. :func:`make_ipc_dir` writes the owner's pid into each new folder; :func:`remove_stale_ipc_dirs`
(called at every start) deletes folders whose owner is gone: the recorded pid is not alive, or, for a
folder without a pid file, no socket in it accepts a connection.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import socket
import tempfile
import time

logger = logging.getLogger(__name__)

IPC_PREFIX = "sglang-ipc-"
OWNER_FILE = "owner.pid"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _any_socket_listening(folder: str) -> bool:
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            if not os.path.exists(path) or os.path.isdir(path) or name == OWNER_FILE:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(0.2)
                s.connect(path)
                return True
        except OSError:
            continue
    return False


def is_stale(folder: str) -> bool:
    """Whether the IPC folder's server is gone (see the module docstring)."""
    try:
        with open(os.path.join(folder, OWNER_FILE)) as f:
            return not _pid_alive(int(f.read().strip()))
    except (OSError, ValueError):
        pass
    try:
        return not _any_socket_listening(folder)
    except OSError:
        return False


def remove_stale_ipc_dirs(tmp_dir: str | None = None, min_age_s: float = 60.0) -> list[str]:
    """Delete the ``sglang-ipc-*`` folders of dead servers in ``tmp_dir`` (default: the system temp folder).

    Folders changed in the last ``min_age_s`` seconds are kept (a server may be starting in them).

    Returns:
        The removed paths (folders owned by another user or still in use are kept).
    """
    removed = []
    for folder in glob.glob(os.path.join(tmp_dir or tempfile.gettempdir(), IPC_PREFIX + "*")):
        try:
            st = os.stat(folder)
            if (not os.path.isdir(folder) or st.st_uid != os.getuid() or time.time() - st.st_mtime < min_age_s
                    or not is_stale(folder)):
                continue
        except OSError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if not os.path.exists(folder):
            removed.append(folder)
    if removed:
        logger.info("removed %d IPC folder(s) left by servers that are gone", len(removed))
    return removed


def make_ipc_dir() -> str:
    """A fresh private ``sglang-ipc-*`` folder with this process's pid recorded (stale ones removed first)."""
    remove_stale_ipc_dirs()
    d = tempfile.mkdtemp(prefix=IPC_PREFIX)
    with open(os.path.join(d, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return d
