"""Minimal CUDA driver-API bindings (ctypes over ``libcuda.so.1``) for the symmetric heap's CUDA IPC mapping.

Why the driver API and not torch's allocator: the heap must be one dedicated allocation per rank whose base address
is the start of an IPC-exportable allocation (``cuIpcGetMemHandle`` exports whole allocations; torch's caching
allocator sub-allocates, so a tensor's pointer may sit inside a larger segment), it must never be returned to a
cache, and it must be mappable by peers *on the same device* (ranks sharing one GPU) as well as on other GPUs. The
driver is always present where a GPU is, so this adds no dependency. Legacy CUDA IPC maps memory without creating any
multicast object (NVLink SHARP / NVLS stays untouched, as our hosts require).
"""

from __future__ import annotations

import ctypes
from typing import Optional

IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
_LAZY_ENABLE_PEER_ACCESS = 0x1


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUresult."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_lib: Optional[ctypes.CDLL] = None


def _driver() -> ctypes.CDLL:
    global _lib  # a loaded shared library is process state by nature; loading twice is harmless
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaDriverError(f"libcuda.so.1 not found ({e}): the CUDA IPC heap needs an NVIDIA driver") from e
    return _lib


def _check(name: str, rc: int) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        try:
            _driver().cuGetErrorString(rc, ctypes.byref(msg))
        except Exception:
            pass
        raise CudaDriverError(f"{name} failed: CUresult {rc} ({(msg.value or b'?').decode()})")


def mem_alloc(nbytes: int) -> int:
    """cuMemAlloc in the current context (make it current first, e.g. any torch.cuda op on the device)."""
    p = ctypes.c_uint64()
    _check("cuMemAlloc_v2", _driver().cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(nbytes)))
    return p.value


def mem_free(ptr: int) -> None:
    """cuMemFree of a pointer from :func:`mem_alloc`."""
    _check("cuMemFree_v2", _driver().cuMemFree_v2(ctypes.c_uint64(ptr)))


def memset_d8(ptr: int, value: int, nbytes: int) -> None:
    """Synchronous byte memset (used once, to zero a fresh heap before any peer can signal into it)."""
    _check("cuMemsetD8_v2", _driver().cuMemsetD8_v2(ctypes.c_uint64(ptr), ctypes.c_ubyte(value),
                                                    ctypes.c_size_t(nbytes)))


def ipc_get_handle(ptr: int) -> bytes:
    """The 64-byte IPC handle of the allocation starting at ``ptr``."""
    h = _Handle()
    _check("cuIpcGetMemHandle", _driver().cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(ptr)))
    # bytes(h) copies all 64 bytes; h.reserved (a c_char array) would stop at the first NUL byte
    return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES)


def ipc_open(handle: bytes) -> int:
    """Map a peer's allocation (from another process; same or other device) into this process; returns its address."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"IPC handle has {len(handle)} bytes, expected {IPC_HANDLE_BYTES}")
    h = _Handle()
    ctypes.memmove(ctypes.byref(h), handle, IPC_HANDLE_BYTES)
    p = ctypes.c_uint64()
    _check("cuIpcOpenMemHandle_v2", _driver().cuIpcOpenMemHandle_v2(ctypes.byref(p), h,
                                                                    ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS)))
    return p.value


def ipc_close(ptr: int) -> None:
    """Unmap a pointer from :func:`ipc_open`."""
    _check("cuIpcCloseMemHandle", _driver().cuIpcCloseMemHandle(ctypes.c_uint64(ptr)))


# ---- stream memory operations (copy-engine producers) ------------------------------------------------------------
_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """cuMemcpyAsync between device addresses (unified addressing: peers' IPC mappings included): the copy engine
    moves the data, no SM is used."""
    _check("cuMemcpyAsync", _driver().cuMemcpyAsync(ctypes.c_uint64(dst), ctypes.c_uint64(src),
                                                    ctypes.c_size_t(nbytes), ctypes.c_void_p(stream)))


def stream_write_value64(addr: int, value: int, stream: int) -> None:
    """cuStreamWriteValue64 with default flags: after the stream's earlier work, and preceded by a memory fence with
    ``__threadfence_system()``-like semantics (CUDA driver API docs), i.e. a release store at system scope."""
    _check("cuStreamWriteValue64", _driver().cuStreamWriteValue64_v2(
        ctypes.c_void_p(stream), ctypes.c_uint64(addr), ctypes.c_uint64(value), ctypes.c_uint(0)))


def stream_wait_value64(addr: int, value: int, stream: int) -> None:
    """cuStreamWaitValue64 (GEQ): the stream's later work waits until ``*addr >= value``."""
    _check("cuStreamWaitValue64", _driver().cuStreamWaitValue64_v2(
        ctypes.c_void_p(stream), ctypes.c_uint64(addr), ctypes.c_uint64(value), ctypes.c_uint(_WAIT_GEQ)))
