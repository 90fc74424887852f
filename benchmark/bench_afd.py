"""MegaScale-Infer AFD benchmark: decode throughput per worker (AFD vs colocated on the same resources) and M2N
latency vs a point-to-point baseline (paper Fig. 11-12).

Modes (both by default):

* ``--mode decode``: the model (``--model-path`` config; ``--load-format dummy`` for big shapes) decodes
  ``--batch`` requests for ``--steps`` steps (after a prefill of ``--input-len`` tokens) (a) colocated in this
  process and (b) with AFD: this process is the attention worker (:class:`~sglang.srt.afd.executor.AfdExecutor`,
  m = ``--micro-batches``) and ``--ffn-workers`` FFN worker processes hold the experts. Reported: decode
  tokens/s, and tokens/s per worker (AFD uses 1 + N_E workers; colocated 1), and their ratio.
* ``--mode m2n``: two processes; rank 0 sends ``--sizes-kb`` per message to rank 1, which echoes it; one-way
  latency = round trip / 2, median and p99 over ``--iters``. M2N (transport ``inline`` on CPU, ``cuda_ipc`` on
  GPU) vs the baseline ``torch.distributed`` send/recv (gloo on CPU, NCCL on GPU) of the same bytes.

Writes ``benchmark/results/<date>_afd_<mode>[_smoke].md`` with the date, hardware and command. ``--smoke``: CPU,
stories260K-moe-sized shapes, few iterations (for the CPU test; CPU numbers say nothing about GPUs).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


# ---- M2N latency -------------------------------------------------------------------------------------------
def _m2n_rank(rank: int, a, addrs, init: str, q) -> None:
    import torch.distributed as dist

    from sgl_kernel.m2n import M2NConfig, M2NEndpoint, RowLayout

    from sglang.srt.afd.protocol import create_afd_transport

    dev = f"cuda:{rank if torch.cuda.device_count() > 1 else 0}" if a.device == "cuda" else "cpu"
    if a.device == "cuda":
        torch.cuda.set_device(torch.device(dev))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", init_method=init, rank=rank, world_size=2)
    res = {}
    for kb in a.sizes_kb:
        n = kb * 1024 // 4
        layout = RowLayout(((torch.float32, 256),))
        rows = max(1, n // 256)
        ep = M2NEndpoint(M2NConfig(rank, tuple(f"{x}-{kb}" for x in addrs), rows, device=dev),
                         layout, transport=create_afd_transport(a.transport))
        x = torch.randn(rows, 256, device=dev)
        buf = torch.empty(rows * 256, device=dev)
        for name in ("m2n", "p2p"):
            lat = []
            for it in range(a.iters + a.warmup):
                if a.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                if name == "m2n":
                    if rank == 0:
                        ep.send(1, [x])
                        ep.recv()
                    else:
                        msg = ep.recv()
                        ep.send(0, msg.tensors)
                else:
                    if rank == 0:
                        dist.send(x.view(-1), 1)
                        dist.recv(buf, 1)
                    else:
                        dist.recv(buf, 0)
                        dist.send(buf, 0)
                if a.device == "cuda":
                    torch.cuda.synchronize()
                if it >= a.warmup:
                    lat.append((time.perf_counter() - t0) / 2)
            res[(name, kb)] = lat
        dist.barrier()
        ep.close()
    if rank == 0:
        q.put({f"{k[0]}|{k[1]}": v for k, v in res.items()})
    dist.destroy_process_group()


def run_m2n(a) -> list[str]:
    """Spawn two ranks, time M2N vs p2p per size; the markdown table lines."""
    import torch.multiprocessing as mp

    from sglang.srt.utils.common import free_tcp_ports

    d = tempfile.mkdtemp(prefix="bench-m2n-")
    addrs = (f"ipc://{d}/0", f"ipc://{d}/1")
    init = f"tcp://127.0.0.1:{free_tcp_ports(1)[0]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_m2n_rank, args=(r, a, addrs, init, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=a.timeout)
    for p in procs:
        p.join(60)
    base = "NCCL send/recv" if a.device == "cuda" else "gloo send/recv"
    lines = [f"| KB per pair | M2N ({a.transport}) median us | p99 us | {base} median us | p99 us | median ratio |",
             "|---|---|---|---|---|---|"]
    for kb in a.sizes_kb:
        m, p = np.array(res[f"m2n|{kb}"]) * 1e6, np.array(res[f"p2p|{kb}"]) * 1e6
        lines.append(f"| {kb} | {np.median(m):.1f} | {np.percentile(m, 99):.1f} | {np.median(p):.1f} | "
                     f"{np.percentile(p, 99):.1f} | {np.median(m) / np.median(p):.2f}x |")
    return lines


# ---- decode throughput -------------------------------------------------------------------------------------
def _ffn_proc(path: str, load_format: str, device: str, topo, j: int, ready) -> None:
    from sglang.srt.afd.experts import moe_layer_specs
    from sglang.srt.afd.ffn_worker import FfnServer
    from sglang.srt.afd.load_balance import static_placement
    from sglang.srt.configs.model_config import ModelConfig

    torch.set_num_threads(1)
    mc = ModelConfig.from_path(path, None, "auto", device.split(":")[0])
    specs = moe_layer_specs(mc)
    held = static_placement(specs[0].num_experts, topo.num_ffn).worker_experts()[j]
    s = FfnServer(mc, specs, held, load_format, torch.device(device), topo, j)
    ready.put(j)
    try:
        while True:
            s.serve_once(timeout_s=5.0)
    except ConnectionError:
        pass
    finally:
        s.ep.close()


def _decode(h, batch: int, input_len: int, steps: int, executor, vocab: int, sync) -> float:
    """Prefill ``batch`` requests, then time ``steps`` decode steps; returns decode tokens/s."""
    gen = torch.Generator().manual_seed(0)
    h.step([(i, torch.randint(0, vocab, (input_len,), generator=gen).tolist()) for i in range(batch)], executor)
    nxt = [[1]] * batch
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = h.step([(i, nxt[i]) for i in range(batch)], executor)
        nxt = [[int(t)] for t in logits.argmax(-1).tolist()]
    sync()
    return batch * steps / (time.perf_counter() - t0)


def run_decode(a) -> list[str]:
    """Colocated vs AFD decode tokens/s on the same model; the markdown table lines."""
    import torch.multiprocessing as mp
    from sglang.srt.afd.executor import AfdExecutor
    from sglang.srt.afd.protocol import AfdTopology
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.worker_builder import role_spec
    from sglang.srt.model_loader.loader import load_model
    from sglang.test.model_harness import ModelHarness

    dev = "cuda:0" if a.device == "cuda" else "cpu"
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    mc = ModelConfig.from_path(a.model_path, None, "auto", a.device)
    max_len = a.input_len + a.steps + 2
    colo = load_model(mc, a.load_format, dev)
    tps_colo = _decode(ModelHarness(colo, mc, a.batch, max_len, device=dev), a.batch, a.input_len, a.steps, None,
                       mc.vocab_size, sync)
    del colo
    d = tempfile.mkdtemp(prefix="bench-afd-")
    topo = AfdTopology(1, a.ffn_workers, tuple(f"ipc://{d}/{i}" for i in range(1 + a.ffn_workers)),
                       max_rows=max(a.batch * a.input_len, 1024), transport=a.transport, timeout_s=a.timeout)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    ffn_dev = [f"cuda:{(1 + j) % max(1, torch.cuda.device_count())}" if a.device == "cuda" else "cpu"
               for j in range(a.ffn_workers)]
    procs = [ctx.Process(target=_ffn_proc, args=(a.model_path, a.load_format, ffn_dev[j], topo, j, ready), daemon=True)
             for j in range(a.ffn_workers)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=a.timeout)
    attn = load_model(mc, a.load_format, dev, weight_filter=role_spec("attention").weight_filter)
    ex = AfdExecutor(mc, topo, 0, a.micro_batches, torch.device(dev))
    try:
        tps_afd = _decode(ModelHarness(attn, mc, a.batch, max_len, device=dev), a.batch, a.input_len, a.steps, ex,
                          mc.vocab_size, sync)
        c = ex.pipeline_constraint()
    finally:
        ex.ep.close(notify=[topo.ffn_rank(j) for j in range(a.ffn_workers)])
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    workers = 1 + a.ffn_workers
    return ["| setup | workers | decode tok/s | tok/s per worker | per-worker ratio |", "|---|---|---|---|---|",
            f"| colocated | 1 | {tps_colo:.1f} | {tps_colo:.1f} | 1.00x |",
            f"| AFD m={a.micro_batches}, 1 attention + {a.ffn_workers} FFN | {workers} | {tps_afd:.1f} | "
            f"{tps_afd / workers:.1f} | {tps_afd / workers / tps_colo:.2f}x |", "",
            f"Measured pipeline: Ta={c['ta_ms']:.3f} ms, Tf={c['tf_ms']:.3f} ms, Tc={c['tc_ms']:.3f} ms -> "
            f"m >= 2(1+Tc/Tf) = {c['m_min']:.2f} (m = {a.micro_batches})."]


def _hardware(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def parse_args(argv=None):
    """The benchmark's flags (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("decode", "m2n", "all"), default="all")
    p.add_argument("--model-path", default=str(ROOT.parent / "shared" / "data" / "models" / "stories260K-moe"))
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--ffn-workers", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--transport", default="", help="M2N payload transport (default cuda_ipc on GPU, inline on CPU)")
    p.add_argument("--sizes-kb", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU, few iterations (for the CPU test)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--results-dir", default=str(ROOT / "benchmark" / "results"))
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.iters, a.warmup, a.batch, a.steps, a.input_len = "cpu", 5, 1, 4, 3, 4
        a.sizes_kb = [32, 512]
    a.transport = a.transport or ("cuda_ipc" if a.device == "cuda" else "inline")
    if min(a.batch, a.steps, a.input_len, a.ffn_workers, a.micro_batches, a.iters) < 1:
        p.error("--batch, --steps, --input-len, --ffn-workers, --micro-batches, --iters must be >= 1")
    return a


def main(argv=None) -> Path:
    """Run the chosen modes, print and write the tables; returns the results file."""
    a = parse_args(argv)
    lines = [f"# AFD benchmark ({a.mode})", "", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- hardware: {_hardware(a.device)}", f"- command: `python benchmark/bench_afd.py {' '.join(argv or sys.argv[1:])}`",
             f"- model: {a.model_path} ({a.load_format})", ""]
    if a.mode in ("decode", "all"):
        lines += ["## Decode throughput", ""] + run_decode(a) + [""]
    if a.mode in ("m2n", "all"):
        lines += ["## M2N latency (one way)", ""] + run_m2n(a) + [""]
    text = "\n".join(lines)
    print(text)
    d = Path(a.results_dir)
    d.mkdir(parents=True, exist_ok=True)
    out = d / f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d_%H%M}_afd_{a.mode}{'_smoke' if a.smoke else ''}.md"
    out.write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
