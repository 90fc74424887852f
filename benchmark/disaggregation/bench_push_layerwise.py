"""Push mode, layerwise vs after the forward: time from the start of a prefill forward until every KV WRITE to the
decode side is DONE, for the same request, the same rows and the same transfer backend.

* ``after``: the forward runs (plain executor, no listener), then every layer's WRITEs are posted (today's
  after-the-fact push);
* ``layerwise``: the executor calls the :class:`~sglang.srt.disaggregation.layerwise.LayerwisePushListener` after each
  layer's attention, which posts that layer's WRITEs while later layers run (CUDA: per-layer event + posting thread).

The model is a synthetic staged model (the executors' contract): per layer, an attention stage that stores fresh KV
of the request's tokens into a real KV pool, and an MLP stage of ``--mlp-iters`` GEMMs ``[T, H] x [H, H]`` that sets
the compute time per layer. Two transfer agents in this process (``fake``: real sockets and a copy thread; ``nixl``:
UCX) move the rows ``plan_slot_copies`` + ``copies_by_layer`` plan. The ideal ratio after/layerwise is
``(F + X) / max(F, X)`` for forward time F and transfer time X (at most 2 when they are equal).

Usage: python benchmark/disaggregation/bench_push_layerwise.py [--device cpu|cuda] [--backend fake|nixl] [--tokens 1024] ...
Writes ``benchmark/results/disaggregation/<date>_push_layerwise.md`` (``--out-dir``) (date, hardware, command, table);
``--record-dir DIR``: also the project's JSON record + markdown under ``DIR/disaggregation/`` (:func:`push_record`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from types import SimpleNamespace

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a file: the repository root makes the benchmark package importable (--record-dir)
    sys.path.insert(0, _ROOT)

import torch

from sglang.srt.disaggregation.layerwise import LayerwisePush, LayerwisePushListener
from sglang.srt.disaggregation.slot_plan import copies_by_layer, plan_slot_copies
from sglang.srt.disaggregation.transfer import MemRegion, TransferConfig, TransferState, make_transfer_backend
from sglang.srt.layers.stages import LayerState
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.executors import SequentialExecutor


class SynthLayer:
    """input_norm / attention (stores KV of ``fb.slots`` into layer ``i``) / post_attention_norm / mlp (GEMMs)."""

    def __init__(self, i, pool, w, iters, kv_base):
        self.i, self.pool, self.w, self.iters, self.kv_base = i, pool, w, iters, kv_base

    def stage_names(self):
        return ("input_norm", "attention", "post_attention_norm", "mlp")

    def run_stage(self, stage, st):
        if stage == "input_norm" and st.residual is None:
            st.residual = st.hidden
        elif stage == "attention":
            kv = (st.hidden[:, :1] * self.kv_base).reshape(len(st.forward_batch.slots), *self.pool.kv_data.shape[-2:])
            self.pool.kv_layer_view[self.i, 0, st.forward_batch.slot_tensor] = kv.to(self.pool.kv_data.dtype)
            self.pool.kv_layer_view[self.i, 1, st.forward_batch.slot_tensor] = (-kv).to(self.pool.kv_data.dtype)
        elif stage == "mlp":
            h = st.hidden
            for _ in range(self.iters):
                h = torch.tanh(h @ self.w)
            st.hidden = h


class SynthModel:
    def __init__(self, pool, layers, hidden, iters, device):
        g = torch.Generator(device="cpu").manual_seed(0)
        w = (torch.randn(hidden, hidden, generator=g) / hidden ** 0.5).to(device)
        kv_base = torch.randn(1, pool.kv_data.shape[-2] * pool.kv_data.shape[-1], generator=g).to(device)
        self.decoder_layers = [SynthLayer(i, pool, w, iters, kv_base) for i in range(layers)]

    def embed(self, ids):
        return torch.ones(len(ids), self.decoder_layers[0].w.shape[0], device=ids.device) * 0.01 * ids[:, None]

    def final_norm(self, hidden, residual):
        return hidden + residual

    def compute_logits(self, hidden, fb):
        return hidden[-1:]

    def __call__(self, ids, positions, fb):
        st = LayerState(self.embed(ids), None, positions, fb)
        for layer in self.decoder_layers:
            for stage in layer.stage_names():
                layer.run_stage(stage, st)
        return self.compute_logits(self.final_norm(st.hidden, st.residual), fb)


def push_record(res: dict, args, nbytes: int, nrows: int, kv_equal: bool, env=None, command=None) -> dict:
    """``--record-dir``: the medians ``res`` (seconds: ``forward``, ``transfer``, ``after``, ``layerwise``) as a
    :mod:`benchmark.common.records` record (subject disaggregation, ``mode`` = ``<backend>-<device>``, ``what`` =
    ``push_layerwise``): one row per path with ``time_ms``; the after-the-forward push is the same-run baseline
    (``after_ms`` on the after and layerwise rows, ``speedup`` = after / path); the layerwise row's floor is perfect
    overlap, ``overlap_floor_ms`` = max(forward, transfer), with ``over_floor``. Headline: layerwise vs after, and the
    ideal ratio (F + X) / max(F, X) it is bounded by."""
    from benchmark.common import records

    f, x, after, lw = (res[k] * 1e3 for k in ("forward", "transfer", "after", "layerwise"))
    rows = [{"path": p, "time_ms": t, "after_ms": base, "overlap_floor_ms": floor}
            for p, t, base, floor in (("forward only", f, None, None), ("transfer only", x, None, None),
                                      ("after the forward", after, after, None),
                                      ("layerwise", lw, after, max(f, x)))]
    rows = records.add_ratio(records.add_ratio(rows, "speedup", "after_ms", "time_ms"), "over_floor", "time_ms",
                             "overlap_floor_ms")
    headline = [{"label": "forward start -> all KV WRITEs DONE, layerwise vs after the forward", "value": round(lw, 3),
                 "unit": "ms", "baseline": round(after, 3), "ratio": rows[3]["speedup"]},
                {"label": "ideal ratio (F + X) / max(F, X)", "value": round((f + x) / max(f, x), 3), "unit": "x"}]
    params = {k: getattr(args, k) for k in ("device", "backend", "layers", "tokens", "kv_heads", "head_dim", "hidden",
                                            "mlp_iters", "repeats", "threads")}
    return records.make_record(
        subject="disaggregation", benchmark="benchmark.disaggregation.bench_push_layerwise",
        mode=f"{args.backend}-{args.device.split(':')[0]}", what="push_layerwise", rows=rows,
        params=dict(params, kv_bytes=nbytes, copy_rows=nrows, kv_equal_after_runs=kv_equal),
        baselines=["after_ms"], units={"time_ms": "ms", "after_ms": "ms", "overlap_floor_ms": "ms"},
        floor={"column": "overlap_floor_ms", "what": "max(forward only, transfer only): the two fully overlapped"},
        headline=headline, notes=[f"median of {args.repeats} runs per path; speedup = after / path"],
        gpu_count=1 if args.device.startswith("cuda") else 0, env=env, command=command)


def main(argv=None) -> None:
    """CLI entry (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="fake", choices=["fake", "nixl"])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256, help="H of the synthetic MLP GEMMs")
    ap.add_argument("--mlp-iters", type=int, default=2, help="GEMMs per layer (the compute time per layer)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: OpenMP workers spinning after a GEMM would starve the copy thread)")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))), "benchmark", "results", "disaggregation"))
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(ap, "disaggregation")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    torch.set_num_threads(args.threads)
    hidden = args.hidden
    slots_total = args.tokens + 16
    src = MHATokenToKVPool(slots_total, 1, torch.float16, args.kv_heads, args.head_dim, args.layers, args.device)
    dst = MHATokenToKVPool(slots_total, 1, torch.float16, args.kv_heads, args.head_dim, args.layers, args.device)
    devname = "cpu" if dev.type == "cpu" else f"cuda:{dev.index or 0}"
    cfg = TransferConfig(transfer_timeout_s=120.0)
    prefill = make_transfer_backend(args.backend, "bench-push-prefill", cfg)
    decode = make_transfer_backend(args.backend, "bench-push-decode", cfg)
    prefill.register([MemRegion(src.describe().base_address, src.describe().nbytes, devname)])
    decode.register([MemRegion(dst.describe().base_address, dst.describe().nbytes, devname)])
    prefill.connect("bench-push-decode", decode.local_metadata())
    src_slots = list(range(1, 1 + args.tokens))
    dst_slots = list(range(1, 1 + args.tokens))
    copies = plan_slot_copies(src.describe(), (0, args.kv_heads), src_slots, dst.describe(), (0, args.kv_heads),
                              dst_slots)
    per_layer = [c[:, [1, 0, 2]] for c in copies_by_layer(copies, src.describe(), side=0)]
    nbytes = int(copies[:, 2].sum())
    model = SynthModel(src, args.layers, hidden, args.mlp_iters, dev)
    ids = torch.arange(args.tokens, device=dev)
    fb = SimpleNamespace(input_ids=ids, positions=ids, slots=src_slots, req_pool_indices_cpu=[0],
                         slot_tensor=torch.tensor(src_slots, device=dev),
                         attn_backend=SimpleNamespace(init_forward_metadata=lambda fb: None))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def wait_all(handles):
        for h in handles:
            if prefill.wait(h, timeout_s=120, sleep_s=1e-4) is not TransferState.DONE:
                raise RuntimeError("a WRITE failed")

    def forward_only():
        sync()
        t = time.perf_counter()
        SequentialExecutor().run(model, fb)
        sync()
        return time.perf_counter() - t

    def after():
        sync()
        t = time.perf_counter()
        SequentialExecutor().run(model, fb)
        sync()
        handles = [prefill.write("bench-push-decode", rows) for rows in per_layer if len(rows)]
        wait_all(handles)
        return time.perf_counter() - t

    listener = LayerwisePushListener(prefill)
    ex = SequentialExecutor()
    ex.set_kv_layer_listener(listener)

    def layerwise():
        job = LayerwisePush(room=0, peers=[("bench-push-decode", per_layer)], num_layers=args.layers)
        listener.arm([0], [job])
        sync()
        t = time.perf_counter()
        ex.run(model, fb)
        while not job.done:
            time.sleep(1e-4)
        if job.error:
            raise RuntimeError(job.error)
        wait_all(job.handles)
        return time.perf_counter() - t

    def transfer_only():
        t = time.perf_counter()
        wait_all([prefill.write("bench-push-decode", rows) for rows in per_layer if len(rows)])
        return time.perf_counter() - t

    for fn in (forward_only, transfer_only, after, layerwise):  # warm up
        fn()
    res = {name: statistics.median(fn() for _ in range(args.repeats))
           for name, fn in (("forward", forward_only), ("transfer", transfer_only), ("after", after),
                            ("layerwise", layerwise))}
    sync()
    ok = torch.equal(dst.kv_layer_view[:, :, dst_slots].cpu(), src.kv_layer_view[:, :, src_slots].cpu())
    ideal = (res["forward"] + res["transfer"]) / max(res["forward"], res["transfer"])
    lines = [
        f"# push mode: layerwise vs after the forward ({datetime.date.today().isoformat()})",
        "",
        f"- hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
        + (f", {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else "") + f"; load avg {os.getloadavg()[0]:.1f}",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- {args.layers} layers x {args.tokens} tokens x {args.kv_heads} KV heads x {args.head_dim} (fp16): "
        f"{nbytes / 2**20:.1f} MiB in {len(copies)} rows; backend {args.backend}, device {args.device}; "
        f"median of {args.repeats}; torch threads {args.threads}; decode KV equals prefill KV after the runs: {ok}",
        "",
        "| path | forward start -> all WRITEs DONE (ms) | ratio vs after |",
        "|---|---|---|",
        f"| forward only | {res['forward'] * 1e3:.1f} | |",
        f"| transfer only | {res['transfer'] * 1e3:.1f} | |",
        f"| after the forward (baseline) | {res['after'] * 1e3:.1f} | 1.00 |",
        f"| layerwise | {res['layerwise'] * 1e3:.1f} | {res['after'] / res['layerwise']:.2f} |",
        "",
        f"ideal ratio (F + X) / max(F, X) = {ideal:.2f}",
        "",
        "On CPU the fake backend's copy and socket threads share the host cores (and the GIL) with the forward, so",
        "little overlap is possible there; the gain needs a transport that moves bytes without the host CPU (NIXL:",
        "CUDA IPC / RDMA), measured with --device cuda --backend nixl (scripts/gpu/pd_push_layerwise.sh).",
    ]
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{datetime.date.today().isoformat()}_push_layerwise_{args.device.split(':')[0]}.md")
    with open(path, "w") as f:
        f.write(text + "\n")
    if args.record_dir:
        from benchmark.common.records import write_record

        print(f"record: {write_record(push_record(res, args, nbytes, len(copies), ok), args.record_dir)[0]}")
    listener.close()
    prefill.close()
    decode.close()
    if not ok:
        raise SystemExit("the decode KV differs from the prefill KV")


if __name__ == "__main__":
    main()
