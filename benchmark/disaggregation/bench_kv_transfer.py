"""KV transfer micro-benchmark: message passing vs one read per block vs coalesced reads (KVDirect,
Chen et al. 2024, sec. 4.2 and Fig. 9-10 in spirit).

Two processes, like a prefill and a decode worker: the *prefill* child owns a KV pool in a Llama-3.1-8B
layout (``[layer, K/V, slot, kv_head, head_dim]`` bf16 from ``config.json``: 32 layers x 8 KV heads x 128,
2 KB per token per layer per K/V) and the *decode* parent moves ``N`` blocks of it into its own pool. A
block is one page of one (layer, K/V): ``page_size x 2 KB``, so 4/16/64 KB blocks are pages of 2/8/32
tokens. Three methods, timed in the same run on the same pools:

* ``msg``: the message-passing baseline. Decode asks prefill (control pipe) to *gather* the blocks into a
  contiguous staging buffer, *sends* it (one contiguous transfer of the staging buffer on the same
  transport), then *scatters* it into its pages.
* ``per_block``: one-sided reads, one range per block (``plan_kv_reads`` without coalescing), one post.
* ``coalesced``: the same plan after :func:`coalesce` (merge when remote and local are contiguous).

Pages are allocated in runs of ``--run-pages`` consecutive pages at random places on each side (0: all
contiguous, as a fresh pool gives). Every method is checked byte for byte (CRC32 of the source blocks vs
the destination blocks) before it is timed. Prints a table of median GB/s and the ratios
``coalesced / per_block`` and ``coalesced / msg``, and writes ``benchmark/results/disaggregation/<date>_kv_transfer_<dev>
.{md,json}`` (date, hardware, command).

Examples::

    python benchmark/disaggregation/bench_kv_transfer.py                         # CPU host memory, nixl if installed
    python benchmark/disaggregation/bench_kv_transfer.py --backend fake --smoke  # tiny, for tests
    python benchmark/disaggregation/bench_kv_transfer.py --device cuda           # GPU memory (VRAM via NIXL/UCX)
    python benchmark/disaggregation/bench_kv_transfer.py --record-dir benchmark/results  # + a benchmark record

``--record-dir DIR`` also writes a :mod:`benchmark.common.records` record (``what`` = ``kv_transfer``) under
``DIR/disaggregation/``, with ``msg`` and ``per_block`` as the same-run baselines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "sgl-kernel" / "python"), str(ROOT)]
DEFAULT_CONFIG = ROOT.parent / "shared" / "data" / "configs" / "meta-llama--Meta-Llama-3.1-8B"
TOKEN_BYTES_FALLBACK = dict(num_hidden_layers=32, num_key_value_heads=8, head_dim=128)  # Llama-3.1-8B


def model_shape(config_dir: str) -> dict:
    """(layers, kv_heads, head_dim) from a HF ``config.json`` (Llama-3.1-8B numbers when absent)."""
    p = Path(config_dir) / "config.json"
    if not p.exists():
        return dict(TOKEN_BYTES_FALLBACK, source="builtin Llama-3.1-8B shape (config.json not found)")
    cfg = json.loads(p.read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return dict(num_hidden_layers=cfg["num_hidden_layers"], num_key_value_heads=cfg["num_key_value_heads"],
                head_dim=head_dim, source=str(p))


def _make_pool(shape: dict, page_size: int, n_pages: int, device: str, seed: int):
    import torch

    from sglang.srt.mem_cache.kv_cache import KVCache

    # n_pages pages in all: the pool adds its dummy page 0 to max_total_tokens
    kv = KVCache.create(max_total_tokens=(n_pages - 1) * page_size, page_size=page_size, dtype=torch.bfloat16,
                        head_num=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                        layer_num=shape["num_hidden_layers"], req_rows=1, max_context_len=8, device=device)
    data = kv.token_to_kv_pool.kv_data
    if seed >= 0:
        g = torch.Generator(device=device).manual_seed(seed)
        data.view(torch.int16).copy_(torch.randint(-2 ** 15, 2 ** 15, data.shape, generator=g, device=device,
                                                   dtype=torch.int16))
    return kv, data


def _block_view(data, n_pages_total: int):
    """Pool as ``int64 [layers * 2 * pages, block_bytes / 8]``: row ``(l * 2 + kv) * pages + p`` is one block.
    (int64 rows: torch's CPU index_select/index_copy_ on uint8 rows is tens of times slower, which would
    make the message-passing baseline look worse than it is.)"""
    import torch

    return data.view(torch.int64).reshape(data.shape[0] * 2 * n_pages_total, -1)


def _recv(conn, proc, timeout: float = 300.0):
    """Next message from the prefill child; RuntimeError if it died or went silent (never a hang)."""
    end = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"the prefill process exited with code {proc.exitcode}")
        if time.monotonic() > end:
            raise RuntimeError(f"the prefill process did not answer within {timeout}s")
    return conn.recv()


def _block_rows(pages, n_layers: int, n_pages_total: int):
    import torch

    p = torch.as_tensor(pages, dtype=torch.int64)
    lk = torch.arange(n_layers * 2, dtype=torch.int64)[:, None] * n_pages_total
    return (lk + p[None, :]).reshape(-1)  # (layer, K/V, page) order, as plan_kv_reads emits


def _crc(t) -> int:
    return zlib.crc32(t.contiguous().cpu().numpy().tobytes())


def _child(conn, backend: str, shape: dict, page_size: int, n_pages_total: int, device: str, max_blocks: int):
    """The prefill worker: pool + staging buffer; serves gather/checksum over the pipe."""
    import torch

    from sglang.srt.disaggregation.transfer import MemRegion, TransferConfig, make_transfer_backend

    kv, data = _make_pool(shape, page_size, n_pages_total, device, seed=1234)
    blocks = _block_view(data, n_pages_total)
    staging = torch.empty((max_blocks, blocks.shape[1]), dtype=torch.int64, device=device)
    agent = make_transfer_backend(backend, "bench-prefill", TransferConfig(transfer_timeout_s=120.0))
    dev = "cpu" if device == "cpu" else f"cuda:{torch.device(device).index or 0}"
    agent.register([MemRegion(data.data_ptr(), data.numel() * data.element_size(), dev),
                    MemRegion(staging.data_ptr(), staging.numel() * 8, dev)])
    conn.send((agent.local_metadata(), kv.describe().to_dict(), staging.data_ptr()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "gather":  # message passing: the prefill CPU/GPU copies the blocks into staging
            rows = torch.as_tensor(arg, device=device)
            torch.index_select(blocks, 0, rows, out=staging[: len(rows)])
            if device != "cpu":
                torch.cuda.synchronize()
            conn.send(True)
        elif cmd == "crc":
            conn.send(_crc(blocks[torch.as_tensor(arg, device=device)]))
        elif cmd == "exit":
            agent.close()
            conn.send(True)
            return


def _pages(n: int, total: int, run: int, rng) -> list[int]:
    """``n`` distinct page ids in [1, total): consecutive runs of ``run`` pages at random places (0: one run)."""
    if run <= 0 or run >= n:
        start = int(rng.integers(1, total - n + 1))
        return list(range(start, start + n))
    slots = (total - 1) // run
    picks = rng.choice(slots, -(-n // run), replace=False)
    return [1 + int(s) * run + i for s in picks for i in range(run)][:n]


def run_block_size(args, shape, block_kb: int, counts: list[int], rng) -> list[dict]:
    import numpy as np
    import torch

    from sglang.srt.disaggregation.transfer import MemRegion, TransferConfig, TransferState, make_transfer_backend
    from sglang.srt.disaggregation.transfer.kv_plan import coalesce_array, plan_kv_reads_array
    from sglang.srt.mem_cache.kv_descriptor import KVRegionDescriptor

    token_bytes = shape["num_key_value_heads"] * shape["head_dim"] * 2
    if (block_kb * 1024) % token_bytes:
        raise ValueError(f"block size {block_kb} KB is not a whole number of tokens ({token_bytes} B each)")
    page_size = block_kb * 1024 // token_bytes
    n_layers = shape["num_hidden_layers"]
    max_pages = max(counts) // (2 * n_layers)
    n_pages_total = max_pages * (2 if args.run_pages else 1) + 2
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child_conn, args.backend, shape, page_size, n_pages_total, args.device,
                                            max(counts)), daemon=True)
    proc.start()
    rows = []
    me = None
    try:
        md, rdesc, r_staging = _recv(conn, proc)
        rdesc = KVRegionDescriptor.from_dict(rdesc)
        kv, data = _make_pool(shape, page_size, n_pages_total, args.device, seed=-1)
        blocks = _block_view(data, n_pages_total)
        staging = torch.empty((max(counts), blocks.shape[1]), dtype=torch.int64, device=args.device)
        me = make_transfer_backend(args.backend, "bench-decode", TransferConfig(transfer_timeout_s=120.0))
        dev = "cpu" if args.device == "cpu" else f"cuda:{torch.device(args.device).index or 0}"
        me.register([MemRegion(data.data_ptr(), data.numel() * data.element_size(), dev),
                     MemRegion(staging.data_ptr(), staging.numel() * 8, dev)])
        me.connect("bench-prefill", md)
        ldesc = kv.describe()
        sync = (lambda: torch.cuda.synchronize()) if args.device != "cpu" else (lambda: None)

        for n_blocks in counts:
            n_pages = n_blocks // (2 * n_layers)
            rp = _pages(n_pages, n_pages_total, args.run_pages, rng)
            lp = _pages(n_pages, n_pages_total, args.run_pages, rng)
            rrows, lrows = _block_rows(rp, n_layers, n_pages_total), _block_rows(lp, n_layers, n_pages_total)
            lrows_dev = lrows.to(args.device)
            per_block = plan_kv_reads_array(rdesc, ldesc, rp, lp)
            assert len(per_block) == n_blocks, (len(per_block), n_blocks)
            coalesced = coalesce_array(per_block)
            nbytes = int(per_block[:, 2].sum())
            conn.send(("crc", rrows.tolist()))
            want = _recv(conn, proc)

            def read(ops):
                h = me.read("bench-prefill", ops)
                if me.wait(h, timeout_s=120, sleep_s=0) is not TransferState.DONE:
                    raise RuntimeError(f"transfer failed: {h.error}")

            def msg():
                conn.send(("gather", rrows.tolist()))
                _recv(conn, proc)
                read(np.array([[r_staging, staging.data_ptr(), nbytes]], dtype=np.int64))  # one contiguous send
                blocks.index_copy_(0, lrows_dev, staging[:n_blocks])
                sync()

            methods = {"msg": msg, "per_block": lambda: read(per_block), "coalesced": lambda: read(coalesced)}
            res = {"block_kb": block_kb, "page_size": page_size, "blocks": n_blocks, "bytes": nbytes,
                   "reads_per_block": len(per_block), "reads_coalesced": len(coalesced)}
            for name, fn in methods.items():
                blocks.zero_()
                fn()
                got = _crc(blocks[lrows_dev])
                if got != want:
                    raise RuntimeError(f"{name}: destination blocks differ from the source (crc {got} != {want})")
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                med = statistics.median(times)
                res[f"{name}_ms"] = med * 1e3
                res[f"{name}_gbps"] = nbytes / med / 1e9
            res["coalesced_vs_per_block"] = res["coalesced_gbps"] / res["per_block_gbps"]
            res["coalesced_vs_msg"] = res["coalesced_gbps"] / res["msg_gbps"]
            rows.append(res)
            print(_fmt_row(res), flush=True)
    finally:
        if me is not None:
            me.close()
        try:
            conn.send(("exit", None))
            conn.poll(10) and conn.recv()
        except (OSError, EOFError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return rows


HEADER = ("| block | blocks | MB | reads per-block / coalesced | msg GB/s | per-block GB/s | coalesced GB/s | "
          "coalesced/per-block | coalesced/msg |\n|---|---|---|---|---|---|---|---|---|")


def _fmt_row(r: dict) -> str:
    return (f"| {r['block_kb']} KB | {r['blocks']} | {r['bytes'] / 2 ** 20:.0f} | {r['reads_per_block']} / "
            f"{r['reads_coalesced']} | {r['msg_gbps']:.2f} | {r['per_block_gbps']:.2f} | {r['coalesced_gbps']:.2f} "
            f"| {r['coalesced_vs_per_block']:.2f}x | {r['coalesced_vs_msg']:.2f}x |")


def _hardware(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    hw = f"{cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start"
    if device != "cpu":
        import torch

        hw += f", {torch.cuda.get_device_name(torch.device(device))}"
    return hw


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default=None, help="nixl | fake (default: nixl if it imports, else fake)")
    ap.add_argument("--device", default="cpu", help="cpu (host memory) or cuda / cuda:N")
    ap.add_argument("--model-config", default=str(DEFAULT_CONFIG), help="folder with config.json (KV layout)")
    ap.add_argument("--block-kb", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--max-mb", type=float, default=256.0, help="skip (block size, count) moving more than this")
    ap.add_argument("--run-pages", type=int, default=0, help="pages per contiguous run (0: all contiguous)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes for tests (2 layers, 2 heads, 64 dim)")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmark" / "results" / "disaggregation"))
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(ap, "disaggregation")
    args = ap.parse_args(argv)
    import numpy as np

    from sglang.srt.disaggregation.transfer.base import nixl_available

    if args.backend is None:
        args.backend = "nixl" if nixl_available()[0] else "fake"
    if args.device != "cpu" and args.backend == "fake":
        ap.error("--device cuda needs --backend nixl (the fake backend moves host memory only)")
    shape = model_shape(args.model_config)
    if args.smoke:
        shape = dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=64, source="smoke shape")
        args.block_kb, args.blocks, args.reps = [4], [16, 64], 2
    rng = np.random.default_rng(args.seed)
    token_bytes = shape["num_key_value_heads"] * shape["head_dim"] * 2
    print(f"# KV layout: {shape['num_hidden_layers']} layers x {shape['num_key_value_heads']} KV heads x "
          f"{shape['head_dim']} bf16 ({token_bytes} B per token per layer per K/V), from {shape['source']}")
    print(f"# backend={args.backend} device={args.device} run_pages={args.run_pages} reps={args.reps}")
    print(HEADER, flush=True)
    rows, skipped = [], []
    for kb in args.block_kb:
        counts = [n for n in args.blocks if n * kb / 1024 <= args.max_mb and n % (2 * shape["num_hidden_layers"]) == 0]
        skipped += [f"{kb} KB x {n}" for n in args.blocks if n not in counts]
        if counts:
            rows += run_block_size(args, shape, kb, counts, rng)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    result = {"date": stamp.isoformat(timespec="seconds"), "hardware": _hardware(args.device),
              "command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:])),
              "backend": args.backend, "device": args.device, "shape": shape, "run_pages": args.run_pages,
              "reps": args.reps, "rows": rows, "skipped": skipped}
    if skipped:
        print(f"# skipped (over --max-mb {args.max_mb} or not a multiple of 2 x layers): {', '.join(skipped)}")
    if not args.smoke or args.tag:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        base = out / f"{stamp:%Y-%m-%d}_kv_transfer_{args.device.replace(':', '')}{args.tag}"
        base.with_suffix(".json").write_text(json.dumps(result, indent=1))
        md = [f"# KV transfer: message passing vs one read per block vs coalesced reads", "",
              f"- date: {result['date']}", f"- hardware: {result['hardware']}", f"- command: `{result['command']}`",
              f"- backend: {args.backend}, device: {args.device}, KV layout: {shape}",
              f"- pages: {'contiguous' if not args.run_pages else f'runs of {args.run_pages}'} on both sides; "
              f"median of {args.reps} reps; every method verified byte for byte first", "", HEADER]
        md += [_fmt_row(r) for r in rows]
        if skipped:
            md += ["", f"Skipped: {', '.join(skipped)}"]
        base.with_suffix(".md").write_text("\n".join(md) + "\n")
        print(f"# wrote {base}.md/.json")
    if args.record_dir and rows:
        from benchmark.common import records

        js, _ = records.write_record(make_kv_record(rows, result), Path(args.record_dir))
        print(f"# record: {js}")
    return result


def make_kv_record(rows: list[dict], result: dict, env: dict | None = None) -> dict:
    """The rows as a :mod:`benchmark.common.records` record: ``msg`` and ``per_block`` are the same-run baselines,
    the ratios are the ones the table prints; the headline is the largest transfer's coalesced bandwidth."""
    from benchmark.common import records

    big = max(rows, key=lambda r: (r["bytes"], r["block_kb"]))
    units = {k: "ms" for k in rows[0] if k.endswith("_ms")}
    units.update({k: "GB/s" for k in rows[0] if k.endswith("_gbps")}, bytes="B", block_kb="KB")
    lbl = f"{big['block_kb']} KB blocks x {big['blocks']} ({result['device']}, {result['backend']})"
    return records.make_record(
        subject="disaggregation", benchmark="benchmark.disaggregation.bench_kv_transfer",
        mode=f"{result['backend']}-{result['device']}", what="kv_transfer", rows=rows, command=result["command"],
        params={"backend": result["backend"], "device": result["device"], "run_pages": result["run_pages"],
                "reps": result["reps"], "shape": result["shape"], "skipped": result.get("skipped", [])},
        baselines=("msg_gbps", "per_block_gbps"), units=units, env=env,
        gpu_count=0 if result["device"] == "cpu" else 1,
        headline=[{"label": f"coalesced KV read vs one read per block, {lbl}", "value": big["coalesced_gbps"],
                   "unit": "GB/s", "baseline": big["per_block_gbps"],
                   "ratio": round(big["coalesced_vs_per_block"], 3)},
                  {"label": f"coalesced KV read vs message passing, {lbl}", "value": big["coalesced_gbps"],
                   "unit": "GB/s", "baseline": big["msg_gbps"], "ratio": round(big["coalesced_vs_msg"], 3)}],
        notes=["every method verified byte for byte (CRC32) before timing; medians of the reps"])


if __name__ == "__main__":
    main()
