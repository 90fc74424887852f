"""Probe of CUDA-IPC strategies between two processes on two GPUs (CLI, prints a table).

Rank 1 (sender, cuda:1) publishes a buffer and an inter-process event; rank 0 (receiver, cuda:0) opens them by
one strategy, the sender then sleeps ~30 ms on its stream, writes a pattern and records the event (or, with
``event=sync``, synchronizes), and the receiver waits (stream.wait_event) and copies into its own buffer.
A copy that does not wait reads zeros, so "bytes equal" checks the event wait too. Strategies:

* mem ``own_torch``: torch's shared-storage rebuild (``UntypedStorage._new_shared_cuda``) with the receiver's
  device index (cudaIpcOpenMemHandle in the receiver's context, lazy peer access); copy = same-device copy_.
* mem ``peer_torch``: the same rebuild on the sender's device index (torch.multiprocessing's default);
  copy = torch's cross-device copy_.
* mem ``own_raw``: raw cudaIpcGetMemHandle / cudaIpcOpenMemHandle (ctypes, libcudart) under the receiver's
  device; copy = raw cudaMemcpyAsync on the receiver's stream.
* event ``own`` / ``peer``: ``torch.cuda.Event.from_ipc_handle`` under the receiver's / sender's device;
  ``sync``: no event, the sender synchronizes its stream before "go".

Usage: python scripts/gpu/m2n_ipc_probe.py [--out FILE.md] [--only MEM,EVENT]. Each variant is bounded by
10 s; every failure prints its full traceback. The transport's matching switch: SGL_M2N_IPC_MEM=own|peer,
SGL_M2N_IPC_EVENT=own|peer|sync (sgl_kernel/m2n/cuda_ipc.py).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys
import time
import traceback

import torch

MEMS = ("own_torch", "peer_torch", "own_raw")
EVENTS = ("own", "peer", "sync")
NBYTES = 22 << 20  # >= 20 MiB: the caching allocator gives every sender buffer its own segment (own IPC handle)
STEP_S = 10.0
# the transport's strategies (sgl_kernel/m2n/cuda_ipc.py), best first: no host sync, then the sync fallback
PREFERENCE = (("own_torch", "own"), ("peer_torch", "peer"), ("own_torch", "peer"), ("peer_torch", "own"),
              ("own_torch", "sync"), ("peer_torch", "sync"))


def _cudart():
    """libcudart as loaded by torch (same primary context), found via /proc/self/maps, else the nvidia wheels."""
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = sorted({ln.split()[-1] for ln in f if "libcudart.so" in ln})
    site = os.path.dirname(os.path.dirname(torch.__file__))
    paths += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so*")))
    for p in paths:
        try:
            return ctypes.CDLL(p)
        except OSError:
            continue
    raise RuntimeError("libcudart not found (raw strategy unavailable)")


class _IpcHandle(ctypes.Structure):
    """cudaIpcMemHandle_t: 64 opaque bytes, passed by value to cudaIpcOpenMemHandle."""

    _fields_ = [("reserved", ctypes.c_byte * 64)]


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} returned cudaError {rc}")


def _base(dev):
    return (torch.arange(NBYTES, device=dev, dtype=torch.int64) % 251).to(torch.uint8)


def _sender(conn, variants) -> None:
    dev = torch.device("cuda", 1 % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    base = _base(dev)
    torch.cuda.synchronize()
    keep = []  # no sender buffer is ever freed: no two variants share an allocation (and an IPC handle)
    for i, (mem, event) in enumerate(variants):
        try:
            buf = torch.zeros(NBYTES, dtype=torch.uint8, device=dev)
            ev = torch.cuda.Event(interprocess=True)
            evh = ev.ipc_handle()  # created on the current device = dev
            share = list(buf.untyped_storage()._share_cuda_())
            raw = b""
            if mem == "own_raw":
                h = _IpcHandle()
                _check(_cudart().cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(buf.data_ptr())),
                       "cudaIpcGetMemHandle")
                raw = bytes(h)
            torch.cuda.synchronize()
            keep.append((buf, ev))
            conn.send(("handles", i, share, raw, evh, dev.index))
            if not conn.poll(STEP_S) or conn.recv()[0] != "opened":
                continue
            s = torch.cuda.current_stream()
            torch.cuda._sleep(50_000_000)  # ~30 ms: a copy that ignores the event reads zeros
            torch.add(base, i + 1, out=buf)  # no temporaries on the sender
            if event == "sync":
                s.synchronize()
            else:
                ev.record(s)
            conn.send(("go", i))
            conn.poll(STEP_S) and conn.recv()
        except Exception:
            conn.send(("sender_error", i, traceback.format_exc()))
    conn.send(("done",))
    time.sleep(1.0)


def _open(mem, event, share, raw, evh, peer_dev, own):
    """Open the sender's buffer/event by one strategy; returns (copy_fn(out), event or None)."""
    share = list(share)
    if mem == "own_raw":
        lib = _cudart()
        ptr = ctypes.c_void_p()
        h = _IpcHandle.from_buffer_copy(raw)
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        with torch.cuda.device(own):  # 1 = cudaIpcMemLazyEnablePeerAccess
            _check(lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, 1), "cudaIpcOpenMemHandle")
        src = ptr.value + int(share[3])  # the storage's offset inside its allocation

        def copy(out):
            _check(lib.cudaMemcpyAsync(ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(src),
                                       ctypes.c_size_t(NBYTES), ctypes.c_int(3),
                                       ctypes.c_void_p(torch.cuda.current_stream(own).cuda_stream)),
                   "cudaMemcpyAsync")
    else:
        share[0] = own if mem == "own_torch" else peer_dev
        share[7] = False  # torch's own producer-event wait off (the sender synchronized): only `event` is tested
        with torch.cuda.device(share[0]):
            st = torch.UntypedStorage._new_shared_cuda(*share)
            src_t = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (NBYTES,))

        def copy(out):
            out.copy_(src_t, non_blocking=True)
    ev = None
    if event != "sync":
        ev_dev = own if event == "own" else peer_dev
        with torch.cuda.device(ev_dev):
            ev = torch.cuda.Event.from_ipc_handle(torch.device("cuda", ev_dev), evh)
    return copy, ev


def _receiver(conn, variants, q) -> None:
    own = 0
    torch.cuda.set_device(own)
    for i, (mem, event) in enumerate(variants):
        t0 = time.perf_counter()
        res = {"mem": mem, "event": event, "result": "timeout", "equal": ""}
        try:
            if not conn.poll(STEP_S):
                raise TimeoutError("no handles from the sender")
            msg = conn.recv()
            if msg[0] != "handles":
                raise RuntimeError(f"sender: {msg}")
            _, _, share, raw, evh, peer_dev = msg
            copy, ev = _open(mem, event, share, raw, evh, peer_dev, own)
            conn.send(("opened", i))
            if not conn.poll(STEP_S):
                raise TimeoutError("no go from the sender")
            msg = conn.recv()
            if msg[0] != "go":
                raise RuntimeError(f"sender: {msg}")
            out = torch.zeros(NBYTES, dtype=torch.uint8, device=own)
            with torch.cuda.device(own):
                if ev is not None:
                    torch.cuda.current_stream(own).wait_event(ev)
                copy(out)
                torch.cuda.synchronize(own)
            res["equal"] = str(bool(torch.equal(out, _base(own) + (i + 1))))
            res["result"] = "ok"
            conn.send(("copied", i))
        except Exception as e:
            res["result"] = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
            res["tb"] = traceback.format_exc()
            if not res["result"].startswith("RuntimeError: sender"):
                conn.send(("failed", i))
        res["ms"] = f"{(time.perf_counter() - t0) * 1e3:.0f}"
        q.put(res)
    q.put(None)


def main(argv=None) -> int:
    """Run the variants in one process pair (rank 0 = cuda:0 receiver, rank 1 = cuda:1 sender)."""
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--only", default="", help="MEM,EVENT: one variant")
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop waiting for results after this long")
    a = ap.parse_args(argv)
    variants = [(m, e) for m in MEMS for e in EVENTS]
    if a.only:
        variants = [tuple(a.only.split(","))]
        if variants[0][0] not in MEMS or variants[0][1] not in EVENTS:
            ap.error(f"--only={a.only!r}: MEM in {MEMS}, EVENT in {EVENTS}")
    if not torch.cuda.is_available():
        ap.error("needs CUDA (2 GPUs for the cross-device case)")
    print(f"GPUs: {torch.cuda.device_count()} ({torch.cuda.get_device_name(0)}); torch {torch.__version__}; "
          f"peer access 0->1: {torch.cuda.can_device_access_peer(0, 1) if torch.cuda.device_count() > 1 else 'n/a'}",
          flush=True)
    ctx = mp.get_context("spawn")
    c0, c1 = ctx.Pipe()
    q = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(c0, variants, q)), ctx.Process(target=_sender, args=(c1, variants))]
    for p in procs:
        p.start()
    rows = ["| mem (copy) | event | result | bytes equal | ms |", "|---|---|---|---|---|"]
    good = set()
    deadline = time.monotonic() + min(a.budget_s, len(variants) * 2 * STEP_S + 20)
    while time.monotonic() < deadline:
        try:
            r = q.get(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:
            break
        if r is None:
            break
        row = f"| {r['mem']} | {r['event']} | {r['result']} | {r['equal']} | {r['ms']} |"
        print(row, flush=True)
        if "tb" in r:
            print(r["tb"], flush=True)
        rows.append(row)
        if r["result"] == "ok" and r["equal"] == "True":
            good.add((r["mem"], r["event"]))
    for p in procs:
        p.join(2)
        if p.is_alive():
            p.kill()
    pick = next((p for p in PREFERENCE if p in good), None)
    rows += ["", f"RECOMMEND SGL_M2N_IPC_MEM={pick[0].split('_')[0]} SGL_M2N_IPC_EVENT={pick[1]}" if pick else
             "RECOMMEND none (no transport strategy delivered equal bytes)"]
    text = "\n".join(["## CUDA IPC probe (rank 0 cuda:0 receives from rank 1 cuda:1)", ""] + rows)
    print(text, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0 if len(rows) == 2 + len(variants) else 1


if __name__ == "__main__":
    sys.exit(main())
