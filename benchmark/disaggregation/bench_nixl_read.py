"""NIXL READ bandwidth between two GPUs of one host, per UCX setting and descriptor count (KVDirect).

KVDirect's decode worker pulls a request's KV with one-sided reads (Chen et al. 2024, sec. 4.1); in sglang-tw that
is :class:`~sglang.srt.disaggregation.transfer.nixl_backend.NixlTransferBackend` over NIXL's UCX plugin, where a
GPU->GPU read inside a host should be a ``cuMemcpyDtoDAsync`` of UCX's cuda_ipc transport over NVLink. This
measures it apart from the serving loop:

* a *target* process registers ``--mib`` MiB on GPU 0 (agent A, filled with a known byte pattern) and an
  *initiator* process registers the same on GPU 1 (agent B); B reads A's buffer split into ``--descs`` equal
  descriptors, all in ONE transfer (one NIXL request, as the transfer queue posts a request's reads);
* rows: ``ours`` = ``NixlTransferBackend.read`` + poll until DONE (descriptor lists and NIXL request built per
  call, as in serving); ``repost`` = one prepared NIXL request re-posted (NIXL and UCX alone);
  ``write`` = ``NixlTransferBackend.write`` of the same bytes (push direction);
* each UCX setting runs in a fresh process pair (UCX reads its environment when the agent starts) with
  ``UCX_PROTO_INFO=y``; the protocol lines UCX prints for ``ucp_get``/``ucp_put`` (which transport: cuda_ipc, or a
  fallback) are kept per setting;
* floor, same run: torch ``copy_`` GPU 0 -> GPU 1 of the same bytes (peer copy), CUDA-event timed, as 1 and as
  ``max(descs)`` chunks.

Every setting first checks the bytes read equal the target's pattern (a mismatch fails the row). Median wall time
per transfer (host clock from post to DONE seen, busy polling), GB/s = bytes / median. Prints a compact table and
writes ``<out-dir>/nixl_read.{md,json}``. ``--device cpu`` runs the same on host memory (DRAM, a check of
the logic where no GPU is present; no floor).

    python benchmark/disaggregation/bench_nixl_read.py --mib 128 --descs 1 8 64 512 --settings default ours tls

``--record-dir DIR`` also writes a :mod:`benchmark.common.records` record (``what`` = ``nixl_read``) under
``DIR/disaggregation/``: every row with the same-run peer-copy floor at its descriptor count (``floor_gbps``) and
the share of it reached (``of_floor``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]

# name -> (UCX/NIXL environment, apply our transport's UCX defaults, --disaggregation-nixl-threads)
SETTINGS: dict[str, tuple[dict, bool, int]] = {
    "default": ({}, False, 0),  # NIXL's and UCX's own defaults
    "ours": ({}, True, 0),  # + nixl_backend.UCX_ENV_DEFAULTS (what serving uses)
    "tls": ({"UCX_TLS": "cuda_ipc,cuda_copy,tcp,self"}, True, 0),
    "threads4": ({}, True, 4),  # the request's descriptors split over 4 UCX workers (own CUDA streams each)
    "no_ipc": ({"UCX_TLS": "^cuda_ipc"}, True, 0),  # what a host-staged / emulated path gives
    "getzc_off": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "off"}, False, 0),
    "rails1": ({"UCX_MAX_RMA_RAILS": "1"}, True, 0),
    "sgl": ({"NIXL_UCX_SGL_ENABLE": "1"}, True, 0),  # NIXL's SGL path (one batched copy, WRITEs only): = ours now
    "sgl_off": ({"NIXL_UCX_SGL_ENABLE": "0"}, True, 0),  # ours without the SGL default: one ucp_put per descriptor
}
# extra NIXL UCX backend parameters per setting (bench only): "workers2" gives the engine a second UCX worker (so a
# UCX context shared by several workers, as num_threads > 0 makes it) without the dedicated threads, to tell which of
# the two makes threads4 hang on GPUs (measured: its first 1-descriptor READ, which is not split, never finished)
BACKEND_PARAMS: dict[str, dict[str, str]] = {"workers2": {"num_workers": "2"}}
SETTINGS["workers2"] = ({}, True, 0)
# UCX's / NIXL's own value of each nixl_backend.UCX_ENV_DEFAULTS key
UCX_OWN_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto", "NIXL_UCX_SGL_ENABLE": "0"}


def proto_lines(text: str) -> list[str]:
    """The ``UCX_PROTO_INFO`` tables UCX printed for RMA (``remote memory read by ucp_get*`` / ``write by
    ucp_put*``): each table's config line, title and rows (size range, protocol, transport), log prefixes
    stripped, each distinct table once, READ tables first, loopback (``self``) tables left out."""
    blocks, cur, prev = [], None, ""
    for raw in text.splitlines():
        ln = re.sub(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*", "", raw).strip()
        if "cfg#" in ln:
            cur, prev = None, ln
        elif "remote memory" in ln and " self cfg#" not in prev:  # loopback tables are not the path measured
            cur = [prev, ln]
            blocks.append(cur)
        elif cur is not None and ln.startswith("|") and "Range" not in ln:
            cur.append(ln)
    uniq = sorted(dict.fromkeys(map(tuple, blocks)), key=lambda b: "read" not in b[1])  # READ tables first
    return [ln for b in uniq for ln in b]


def pattern(nbytes: int, device: str):
    """``uint8 [nbytes]`` on ``device``: byte ``i`` = ``(i * 7 + 3) % 251`` (a period no descriptor size shares)."""
    import torch

    return ((torch.arange(nbytes, dtype=torch.int64, device=device) * 7 + 3) % 251).to(torch.uint8)


def _dev(args, rank: int) -> str:
    return "cpu" if args.device == "cpu" else f"cuda:{rank}"


def _wait_file(path: Path, timeout: float) -> bytes:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.01)
    return path.read_bytes()


def _backend(name: str, setting: str):
    from sglang.srt.disaggregation.agent import NIXL_SPLIT_BATCH
    from sglang.srt.disaggregation.transfer import TransferConfig
    from sglang.srt.disaggregation.transfer.nixl_backend import NixlTransferBackend

    _, defaults, threads = SETTINGS[setting]  # as the server builds it (disaggregation/agent.py)
    extra = BACKEND_PARAMS.get(setting)
    if extra:  # this process makes one agent: pass the extra parameters through NIXL's create_backend
        from sglang.srt.disaggregation.transfer.nixl_backend import import_nixl

        cls = import_nixl().nixl_agent
        orig = cls.create_backend
        cls.create_backend = lambda self, name, params=None: orig(self, name, {**(params or {}), **extra})
    return NixlTransferBackend(name, TransferConfig(transfer_timeout_s=30.0, nixl_ucx_defaults=defaults,
                                                    nixl_num_threads=threads,
                                                    nixl_split_batch_size=NIXL_SPLIT_BATCH if threads else 0))


def run_target(args) -> None:
    """Agent A: the pattern on GPU 0 (or host), metadata to ``<rdv>/target.md``, exits at ``<rdv>/done``."""
    import torch

    from sglang.srt.disaggregation.transfer import MemRegion

    dev = _dev(args, 0)
    if dev != "cpu":
        torch.cuda.set_device(0)
    src = pattern(args.mib << 20, dev)
    agent = _backend("bench-target", args.setting)
    agent.register([MemRegion(src.data_ptr(), src.numel(), dev)])
    rdv = Path(args.rdv)
    (rdv / "target.tmp").write_bytes(agent.local_metadata())
    os.replace(rdv / "target.tmp", rdv / "target.md")
    _wait_file(rdv / "done", args.timeout)
    agent.close()


def _timed(fn, iters: int, warmup: int, max_s: float = 0.5) -> list[float]:
    """Seconds per call after ``warmup`` calls: ``iters`` samples, fewer (at least 3) once ``max_s`` is spent."""
    for _ in range(warmup):
        fn()
    out, end = [], time.perf_counter() + max_s
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if len(out) >= 3 and out[-1] + t0 > end:
            break
    return out


def _ops(src_addr: int, dst_addr: int, nbytes: int, k: int):
    import numpy as np

    if nbytes % k:
        raise ValueError(f"--mib {nbytes >> 20} MiB does not split into {k} equal descriptors")
    off = np.arange(k, dtype=np.int64) * (nbytes // k)
    return np.stack([src_addr + off, dst_addr + off, np.full(k, nbytes // k, np.int64)], axis=1)


def run_initiator(args) -> None:
    """Agent B: READs (and WRITEs) of A's buffer per descriptor count; one JSON line per row on stdout."""
    import torch

    from sglang.srt.disaggregation.transfer import MemRegion, TransferState

    dev, nbytes = _dev(args, 1), args.mib << 20
    if dev != "cpu":
        torch.cuda.set_device(1)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    want = pattern(nbytes, dev)
    import faulthandler

    faulthandler.dump_traceback_later(max(args.timeout - 3.0, 1.0), exit=False)  # a hang prints every thread's stack
    agent = _backend("bench-initiator", args.setting)
    agent.register([MemRegion(dst.data_ptr(), nbytes, dev)])
    _mark("agent created, memory registered")
    md = _wait_file(Path(args.rdv) / "target.md", args.timeout)
    agent.connect("bench-target", md)
    _mark("connected")
    import msgspec

    src_addr = int(msgspec.msgpack.decode(md)["regions"][0][0])
    env = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))}
    for k in args.descs:
        ops = _ops(src_addr, dst.data_ptr(), nbytes, k)

        def once(post=agent.read):
            h = post("bench-target", ops)
            if agent.wait(h, timeout_s=30.0, sleep_s=0) is not TransferState.DONE:
                raise RuntimeError(f"transfer failed: {h.error}")

        dst.zero_()
        once()
        if dev != "cpu":
            torch.cuda.synchronize()
        ok = bool(torch.equal(dst, want))
        _mark(f"{k} descs: READ checked ({ok})")
        rows = [("ours", _timed(once, args.iters, args.warmup), ok)] if ok else []
        if ok:
            rows.append(("repost", _repost_times(agent, ops, args), ok))
            _mark(f"{k} descs: READs timed")
            if args.write:
                rows.append(("write", _timed(lambda: once(agent.write), args.iters, args.warmup),
                             _write_lands(agent, once, dst, want, dev)))
                _mark(f"{k} descs: WRITEs timed")
        for path, ts, good in rows or [("ours", [], ok)]:
            med = statistics.median(ts) if ts else float("nan")
            print(json.dumps({"row": 1, "setting": args.setting, "path": path, "descs": k, "correct": good,
                              "median_ms": 1e3 * med, "gbps": nbytes / med / 1e9 if ts else 0.0,
                              "min_ms": 1e3 * min(ts) if ts else None, "env": env}), flush=True)
    (Path(args.rdv) / "done").write_bytes(b"1")
    agent.close()


def _write_lands(agent, once, dst, want, dev: str) -> bool:
    """WRITE ``255 - pattern`` into the target, READ it back into a zeroed ``dst``: True when the bytes match
    (the READ path was checked first). Leaves the target holding the complement; the READs of the next descriptor
    count are checked against the pattern again after :func:`_restore` (it writes the pattern back)."""
    import torch

    dst.copy_(255 - want)
    once(agent.write)
    dst.zero_()
    once(agent.read)
    if dev != "cpu":
        torch.cuda.synchronize()
    ok = bool(torch.equal(dst, 255 - want))
    dst.copy_(want)  # restore the target's pattern for the next descriptor count's READ check
    once(agent.write)
    return ok


def _mark(msg: str) -> None:
    """Progress line on stderr (an initiator that hangs shows how far it got in the error row)."""
    print(f"[initiator] {msg}", file=sys.stderr, flush=True)


def _repost_times(agent, ops, args) -> list[float]:
    """One NIXL READ request built once and re-posted: NIXL + UCX without our per-call Python work."""
    _, local, lmt, remote, rmt = agent._descs("bench-target", ops)
    nx = agent._agent
    h = nx.initialize_xfer("READ", nx.get_xfer_descs(local, lmt), nx.get_xfer_descs(remote, rmt), "bench-target")

    def once():
        st = nx.transfer(h)
        while st == "PROC":
            st = nx.check_xfer_state(h)
        if st != "DONE":
            raise RuntimeError(f"repost: NIXL state {st}")

    try:
        return _timed(once, args.iters, args.warmup)
    finally:
        nx.release_xfer_handle(h)


def run_floor(args) -> list[dict]:
    """torch ``copy_`` GPU 0 -> GPU 1 (peer copy) of ``--mib`` MiB as 1 and ``max(descs)`` chunks, CUDA events."""
    import torch

    nbytes, rows = args.mib << 20, []
    a = pattern(nbytes, "cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    for k in sorted({1, max(args.descs)}):
        ca, cb = a.view(k, -1), b.view(k, -1)
        with torch.cuda.device(1):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for i in range(args.warmup + args.iters):
                torch.cuda.synchronize(0)
                s.record()
                for j in range(k):
                    cb[j].copy_(ca[j], non_blocking=True)
                e.record()
                e.synchronize()
                if i >= args.warmup:
                    ts.append(s.elapsed_time(e) / 1e3)
        ok = bool(torch.equal(b.cpu(), a.cpu())) if k == 1 else True
        med = statistics.median(ts)
        rows.append({"row": 1, "setting": "torch_copy", "path": "floor", "descs": k, "correct": ok,
                     "median_ms": 1e3 * med, "gbps": nbytes / med / 1e9, "min_ms": 1e3 * min(ts), "env": {}})
    return rows


def run_setting(args, name: str) -> tuple[list[dict], list[str]]:
    """Target + initiator processes for one UCX setting; (rows, UCX protocol lines)."""
    import tempfile

    env = {k: v for k, v in os.environ.items() if not (args.clean_env and k.startswith("UCX_"))}
    env.update(SETTINGS[name][0])
    env.setdefault("UCX_PROTO_INFO", "y")
    rdv = tempfile.mkdtemp(prefix=f"nixl_read_{name}_")
    base = [sys.executable, __file__, "--setting", name, "--rdv", rdv, "--device", args.device, "--mib",
            str(args.mib), "--iters", str(args.iters), "--warmup", str(args.warmup), "--timeout", str(args.timeout),
            "--descs", *map(str, args.descs)] + (["--write"] if args.write else [])
    tgt = subprocess.Popen(base + ["--role", "target"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        ini = subprocess.run(base + ["--role", "initiator"], env=env, capture_output=True, text=True,
                             timeout=args.timeout)
        out = ini.stdout + ini.stderr
        rc = ini.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = "".join(x if isinstance(x, str) else (x or b"").decode() for x in (e.stdout, e.stderr)), "timeout"
    finally:
        try:
            tout, _ = tgt.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            tgt.kill()
            tout, _ = tgt.communicate()
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"row"')]
    proto = proto_lines(out)
    if rc != 0 or not rows:
        keep = [ln for ln in out.splitlines()
                if ln.strip() and "|" not in ln and "+--" not in ln and not ln.startswith('{"row"')]  # no UCX tables
        tail = keep[-14:] + ["target: " + ln for ln in (tout or "").splitlines() if ln.strip()][-2:]
        rows.append({"row": 1, "setting": name, "path": "ERROR", "descs": 0, "correct": False, "median_ms": 0,
                     "gbps": 0.0, "error": f"rc={rc}: " + " / ".join(tail)})
    return rows, proto


def table(rows: list[dict], descs: list[int]) -> str:
    """Markdown: one line per (setting, path), GB/s per descriptor count (``X`` = wrong bytes)."""
    keys = list(dict.fromkeys((r["setting"], r["path"]) for r in rows))
    lines = ["| setting | path | " + " | ".join(f"{k} desc GB/s" for k in descs) + " |",
             "|---|---|" + "---|" * len(descs)]
    for s, p in keys:
        cells = []
        for k in descs:
            r = next((r for r in rows if (r["setting"], r["path"], r["descs"]) == (s, p, k)), None)
            cells.append("-" if r is None else ("X" if not r["correct"] else f"{r['gbps']:.1f} ({r['median_ms']:.3f} ms)"))
        lines.append(f"| {s} | {p} | " + " | ".join(cells) + " |")
    errs = [f"- {r['setting']}: {r['error']}" for r in rows if r.get("error")]
    return "\n".join(lines + ([""] + errs if errs else []))


def best_setting(path: str, descs: int = 64) -> str:
    """The setting with the highest correct ``ours`` READ GB/s at ``descs`` descriptors in a results JSON
    (``--out-dir``); "" when none is correct."""
    rows = json.loads(Path(path).read_text())["rows"]
    ok = [r for r in rows if r["path"] == "ours" and r["descs"] == descs and r["correct"] and r["setting"] in SETTINGS
          and r["setting"] not in BACKEND_PARAMS]  # a bench-only parameter has no server flag
    return max(ok, key=lambda r: r["gbps"])["setting"] if ok else ""


def best_env(path: str, descs: int = 64) -> dict:
    """Environment a server needs to run like the best setting (:func:`best_setting`); ``{}`` for none."""
    name = best_setting(path, descs)
    if not name:
        return {}
    env, defaults, _ = SETTINGS[name]
    return dict(env) if defaults else {**UCX_OWN_DEFAULTS, **env}  # a variable set: the transport leaves it


def parse_args(argv=None) -> argparse.Namespace:
    """CLI; ValueError-style exits (argparse) for unknown settings, non-positive sizes or uneven splits."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=128, help="bytes per transfer, MiB (128 = 1K tokens of Llama-3.1-8B)")
    ap.add_argument("--descs", type=int, nargs="+", default=[1, 8, 64, 512], help="descriptors per transfer")
    ap.add_argument("--settings", nargs="+", default=["default", "ours", "tls"], choices=sorted(SETTINGS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="also time WRITEs (push direction)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--no-floor", action="store_true", help="skip the torch peer-copy floor")
    ap.add_argument("--clean-env", action="store_true", help="drop inherited UCX_* variables per setting")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per setting (both processes)")
    ap.add_argument("--out-dir", default="", help="write nixl_read.{md,json} here")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(ap, "disaggregation")
    ap.add_argument("--best-env", metavar="JSON", help="print K=V lines of the best setting in JSON and exit")
    ap.add_argument("--best-flags", action="store_true", help="with --best-env: print the server flags instead")
    ap.add_argument("--role", choices=("target", "initiator"), help=argparse.SUPPRESS)
    ap.add_argument("--setting", default="default", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    ap.add_argument("--rdv", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.mib <= 0 or a.iters <= 0 or a.warmup < 0 or min(a.descs) <= 0:
        ap.error("--mib, --iters and every --descs must be > 0, --warmup >= 0")
    bad = [k for k in a.descs if (a.mib << 20) % k]
    if bad:
        ap.error(f"--descs {bad} do not divide {a.mib} MiB evenly")
    return a


def main(argv=None) -> None:
    """CLI: ``--best-env`` prints the best measured setting's variables (or flags); ``--role target / initiator``
    runs one side of a two-process READ; else the copy floor and every ``--settings`` row, reported (``report``)
    after each setting."""
    args = parse_args(argv)
    if args.best_env:
        k = 64 if 64 in args.descs else max(args.descs)
        if args.best_flags:
            name = best_setting(args.best_env, k)
            print(f"--disaggregation-nixl-threads {SETTINGS[name][2]}" if name and SETTINGS[name][2] else "")
        else:
            print("\n".join(f"{key}={v}" for key, v in best_env(args.best_env, k).items()))
        return None
    if args.role == "target":
        return run_target(args)
    if args.role == "initiator":
        return run_initiator(args)
    rows, proto = [], {}
    if args.device == "cuda" and not args.no_floor:
        try:
            rows += run_floor(args)
        except Exception as e:  # noqa: BLE001 - the floor row reports the failure, the settings still run
            rows.append({"row": 1, "setting": "torch_copy", "path": "ERROR", "descs": 0, "correct": False,
                         "median_ms": 0, "gbps": 0.0, "error": f"{type(e).__name__}: {e}"})
    for name in args.settings:  # results are written after every setting (a caller's timeout keeps the rest)
        t0 = time.monotonic()
        r, proto[name] = run_setting(args, name)
        rows += r
        print(f"[bench_nixl_read] {name}: {len(r)} rows in {time.monotonic() - t0:.1f} s", flush=True)
        report(args, rows, proto, final=name == args.settings[-1])
    if args.record_dir:
        from benchmark.common import records

        js, _ = records.write_record(make_nixl_record(rows, args), Path(args.record_dir))
        print(f"[bench_nixl_read] record: {js}")


def make_nixl_record(rows: list[dict], args, env: dict | None = None) -> dict:
    """The rows as a :mod:`benchmark.common.records` record: each with the same-run torch peer-copy floor at its
    descriptor count (``floor_gbps``, when measured) and ``of_floor`` = GB/s / floor; the headline is the best correct
    ``ours`` READ at 64 descriptors (or the most measured), against the floor and against NIXL's own defaults."""
    from benchmark.common import records

    floor = {r["descs"]: r["gbps"] for r in rows if r["path"] == "floor" and r["correct"]}
    out = [{**{k: v for k, v in r.items() if k != "row"}, "floor_gbps": floor.get(r["descs"])} for r in rows]
    out = records.add_ratio(out, "of_floor", "gbps", "floor_gbps")
    ours = [r for r in out if r["path"] == "ours" and r["correct"]]
    headline = []
    if ours:
        k = 64 if any(r["descs"] == 64 for r in ours) else max(r["descs"] for r in ours)
        best = max((r for r in ours if r["descs"] == k), key=lambda r: r["gbps"])
        where = "GPU 0 -> GPU 1" if args.device == "cuda" else "host -> host"
        headline.append({"label": f"NIXL READ {args.mib} MiB {where}, {k} descriptors, best setting "
                                  f"({best['setting']}) vs torch peer copy", "value": round(best["gbps"], 2),
                         "unit": "GB/s", "baseline": best["floor_gbps"], "ratio": best["of_floor"]})
        dflt = next((r for r in ours if r["setting"] == "default" and r["descs"] == k), None)
        if dflt is not None and dflt is not best:
            headline.append({"label": f"NIXL READ {k} descriptors, {best['setting']} vs NIXL/UCX defaults",
                             "value": round(best["gbps"], 2), "unit": "GB/s", "baseline": round(dflt["gbps"], 2),
                             "ratio": None if not dflt["gbps"] else round(best["gbps"] / dflt["gbps"], 3)})
    return records.make_record(
        subject="disaggregation", benchmark="benchmark.disaggregation.bench_nixl_read",
        mode=f"{args.device}-{'+'.join(args.settings)}", what="nixl_read", rows=out, env=env,
        params={"mib": args.mib, "descs": list(args.descs), "settings": list(args.settings), "iters": args.iters,
                "warmup": args.warmup, "device": args.device, "write": bool(args.write)},
        baselines=("floor_gbps",) if floor else (), units={"gbps": "GB/s", "floor_gbps": "GB/s", "median_ms": "ms",
                                                           "min_ms": "ms"},
        floor=({"column": "floor_gbps", "what": "torch copy_ GPU 0 -> GPU 1 of the same bytes (peer copy), "
                                               "CUDA-event timed, same run"} if floor else None),
        headline=headline, gpu_count=0 if args.device == "cpu" else 2)


def report(args, rows: list[dict], proto: dict, final: bool) -> None:
    """Markdown table + UCX protocol tables; printed when ``final``, written to ``--out-dir`` every time."""
    where = "GPU 0 -> GPU 1" if args.device == "cuda" else "host -> host"
    md = [f"# NIXL READ {args.mib} MiB {where} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"device {args.device})", "", "command: `python " + " ".join(sys.argv) + "`", "",
          table(rows, args.descs), ""]
    for name, lines in proto.items():
        env = next((r.get("env") for r in rows if r["setting"] == name and r.get("env")), {})
        md += [f"## UCX protocols, {name} (env {env})"] + [f"    {ln}" for ln in lines[:16]] + [""]
    text = "\n".join(md)
    if final:
        print(text)
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.out_dir) / "nixl_read.md").write_text(text)
        (Path(args.out_dir) / "nixl_read.json").write_text(json.dumps({"rows": rows, "proto": proto}))


if __name__ == "__main__":
    main()
