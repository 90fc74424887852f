"""ctypes binding of libtwcomm's C API (tw-comm/include/tw_comm/tw_comm.h).

Only opaque workspace handles (ints) and tensor data pointers pass through here; user code goes through
:mod:`sgl_kernel.tw_comm.ops` (torch ops) or ``sglang.srt.distributed.tw_comm`` (workspace API).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

TW_OK = 0
TW_ERR_ARG = 1
TW_ERR_CUDA = 2
TW_ERR_NVLS_REFUSED = 3
TW_ERR_STATE = 4
IPC_HANDLE_BYTES = 64

_vp, _i, _f, _sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
_SIGNATURES = {
    "tw_last_error": ([], ctypes.c_char_p),
    "tw_workspace_create": ([_i, _i, _i, _sz, ctypes.POINTER(_vp)], _i),
    "tw_workspace_ipc_handle": ([_vp, _vp], _i),
    "tw_workspace_open": ([_vp, _vp], _i),
    "tw_workspace_destroy": ([_vp], _i),
    "tw_workspace_capacity": ([_vp], _sz),
    "tw_oneshot_allreduce_rmsnorm": ([_vp, _vp, _vp, _vp, _vp, _i, _i, _i, _f, _i, _vp], _i),
    "tw_lamport_allreduce_rmsnorm": ([_vp, _vp, _vp, _vp, _vp, _i, _i, _i, _f, _i, _vp], _i),
    "tw_twoshot_allreduce_rmsnorm": ([_vp, _vp, _vp, _vp, _vp, _i, _i, _i, _f, _i, _i, _vp], _i),
    "tw_twoshot_pipe_allreduce_rmsnorm": ([_vp, _vp, _vp, _vp, _vp, _i, _i, _i, _f, _i, _i, _i, _vp], _i),
    "tw_twoshot_bulk_allreduce_rmsnorm": ([_vp, _vp, _vp, _vp, _vp, _i, _i, _i, _f, _i, _i, _vp], _i),
    "tw_ce_allreduce_rmsnorm": ([_vp, _vp, _vp, _vp, _vp, _i, _i, _i, _f, _i, _i, _vp], _i),
    "tw_allreduce": ([_vp, _vp, _vp, _i, _i, _i, _i, _i, _vp], _i),
    "tw_fused_add_rmsnorm": ([_vp, _vp, _vp, _vp, _i, _i, _i, _f, _i, _vp], _i),
    "tw_nvls_gate": ([_i], _i),
    "tw_nvls_allreduce_rmsnorm": ([_vp, _vp, _vp, _vp, _vp, _vp, _vp, _i, _i, _i, _f, _i, _vp], _i),
}


class TwCommError(RuntimeError):
    """A libtwcomm call failed; ``code`` is the tw_status value."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class TwCommLib:
    """Loaded libtwcomm with typed entry points; ``call(name, *args)`` raises on a non-zero status.

    A TW_ERR_ARG status raises ValueError (bad argument caught in C); others raise TwCommError.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lib = ctypes.CDLL(str(self.path))
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(self._lib, name)
            fn.argtypes = argtypes
            fn.restype = restype

    def last_error(self) -> str:
        """The library's last error message (empty if none)."""
        return (self._lib.tw_last_error() or b"").decode(errors="replace")

    def raw(self, name: str, *args) -> int:
        """Call ``name`` and return its raw status (no raise)."""
        return getattr(self._lib, name)(*args)

    def call(self, name: str, *args) -> int:
        """Call entry point ``name`` with ``args`` and return its status; a non-OK status raises ValueError (TW_ERR_ARG)
        or TwCommError (``tw_workspace_capacity`` returns its value unchecked)."""
        rc = getattr(self._lib, name)(*args)
        if name != "tw_workspace_capacity" and rc != TW_OK:
            msg = f"{name}: {self.last_error()}"
            if rc == TW_ERR_ARG:
                raise ValueError(msg)
            raise TwCommError(rc, msg)
        return rc


@functools.lru_cache(maxsize=None)
def load_library(path: Optional[str] = None) -> TwCommLib:
    """Load libtwcomm (building it JIT when ``path`` is None). Cached per process: one library handle."""
    if path is None:
        from sgl_kernel.tw_comm.build import build_library

        path = str(build_library())
    return TwCommLib(Path(path))
