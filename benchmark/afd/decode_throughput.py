"""Decode measurements of ``benchmark/afd/bench.py --mode decode``: the colocated baseline as the server runs it and the AFD
attention worker (MegaScale-Infer, Zhu et al. 2025, sec. 4.1), each against its memory floor.

* Colocated: the real :class:`~sglang.srt.model_executor.model_runner.ModelRunner` (the server's decode path: the
  Triton attention backend, the fused-MoE Triton kernel and, on CUDA, decode CUDA graphs up to the largest batch),
  driven by :class:`sglang.bench_one_batch.StaticBatch`: prefill, untimed warm-up steps, then timed steps.
* AFD: this process is the attention worker (attention role, no experts built) running
  :class:`~sglang.srt.afd.executor.AfdExecutor` over a :class:`~sglang.test.model_harness.ModelHarness` with the
  Triton backend (CUDA) -- eager, since the executor talks to the FFN workers between layers.

Memory floor of a decode step: the parameter bytes a step must read divided by the copy bandwidth measured on the
same GPU in the same process (:func:`copy_bandwidth`). Colocated reads every non-embedding parameter once, the
experts only where a token is routed (expected fraction ``1 - (1 - k/E)^T`` of T tokens under uniform routing).
AFD reads the attention side's weights once per micro-batch on the attention GPU and each FFN worker's held
experts once per micro-batch; the pipelined step is bounded by the slower GPU. KV reads (short prompts here) and
the embedding rows are left out, so the floor is a lower bound.
"""

from __future__ import annotations

import statistics
import time

import torch


def copy_bandwidth(device: str, mib: int = 512, iters: int = 12) -> float:
    """Device-to-device copy bandwidth of ``device`` in bytes/s (read + write counted: ``2 * bytes / time``), the
    median over ``iters`` CUDA-event-timed copies of ``mib`` MiB after one warm-up; on CPU the same with
    ``perf_counter`` (a CPU number says nothing about a GPU)."""
    n = mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        if src.is_cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1e-3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n / statistics.median(times)


def touched_fraction(tokens: int, top_k: int, num_experts: int) -> float:
    """Expected fraction of experts at least one of ``tokens`` tokens is routed to (uniform independent top-k)."""
    return 1.0 - (1.0 - top_k / num_experts) ** max(tokens, 0)


def split_param_bytes(model: torch.nn.Module) -> dict:
    """``{"experts": routed-expert bytes (FusedMoE w13/w2), "embed": input-embedding bytes, "other": the rest}`` of
    ``model`` (tied parameters once, ``meta`` ones skipped)."""
    out = {"experts": 0, "embed": 0, "other": 0}
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen or p.is_meta:
            continue
        seen.add(id(p))
        key = "experts" if ".experts." in name else "embed" if "embed_tokens" in name else "other"
        out[key] += p.numel() * p.element_size()
    return out


def _moe_shape(mc) -> tuple[int, int]:
    from sglang.srt.afd.experts import moe_layer_specs

    s = moe_layer_specs(mc)[0]
    return s.top_k, s.num_experts


def _max_len(a) -> int:
    return a.input_len + a.steps + a.decode_warmup + 4


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure_colocated(a) -> dict:
    """Colocated decode on cuda:0 (or CPU) through the real ModelRunner; per batch: median step seconds, tok/s, the
    bytes a step reads and the floor. Returns ``{"bw": B/s, "param_bytes": .., "rows": {batch: {...}}}``."""
    from sglang.bench_one_batch import StaticBatch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    dev = "cuda:0" if a.device == "cuda" else "cpu"
    if a.device == "cuda":
        torch.cuda.set_device(0)
    bw = copy_bandwidth(dev)
    max_len, max_bs = _max_len(a), max(a.batch)
    sa = ServerArgs(model_path=a.model_path, load_format=a.load_format, device=a.device, skip_tokenizer_init=True,
                    context_length=max_len, max_running_requests=max_bs, max_total_tokens=(max_bs + 2) * max_len,
                    cuda_graph_max_bs=max_bs, disable_cuda_graph=a.device != "cuda", disable_radix_cache=True)
    mc = ModelConfig.from_path(a.model_path, max_len, "auto", a.device)
    runner = ModelRunner(mc, sa, dev)
    parts = split_param_bytes(runner.model)
    top_k, num_e = _moe_shape(mc)
    rows = {}
    gen = torch.Generator().manual_seed(0)
    for b in a.batch:
        prompts = torch.randint(0, mc.vocab_size, (b, a.input_len), generator=gen).tolist()
        sb = StaticBatch(runner, prompts, a.steps + a.decode_warmup + 2)
        try:
            ids = sb.prefill(prompts, None)
            times = []
            for it in range(a.decode_warmup + a.steps):
                _sync(dev)
                t0 = time.perf_counter()
                ids = sb.step([[t] for t in ids])  # ends with the sampled ids on the host (a sync, as the server)
                if it >= a.decode_warmup:
                    times.append(time.perf_counter() - t0)
        finally:
            sb.free()
        step = statistics.median(times)
        read = parts["other"] + parts["experts"] * touched_fraction(b, top_k, num_e)
        rows[b] = {"step_s": step, "tps": b / step, "read_bytes": read, "floor_s": read / bw}
    graphs = runner.cuda_graph_runner
    return {"bw": bw, "param_bytes": sum(parts.values()), "rows": rows, "peak": _peak(a),
            "backend": runner.attention_backend_name,
            "graphs": f"up to batch {graphs.max_bs}" if graphs is not None else "off"}


def _peak(a) -> int:
    return torch.cuda.max_memory_allocated(0) if a.device == "cuda" else 0


def _decode_times(h, batch: int, input_len: int, steps: int, executor, vocab: int, device: str,
                  warmup: int) -> list[float]:
    """Prefill ``batch`` requests of the harness ``h``, ``warmup`` untimed decode steps, then ``steps`` timed ones;
    the per-step seconds (each step ends with the greedy ids on the host, as a server step does)."""
    gen = torch.Generator().manual_seed(0)
    h.step([(i, torch.randint(0, vocab, (input_len,), generator=gen).tolist()) for i in range(batch)], executor,
           poison=False)
    nxt = [1] * batch
    times = []
    for it in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        logits = h.step([(i, [nxt[i]]) for i in range(batch)], executor, poison=False)
        nxt = logits.argmax(-1).tolist()
        if it >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def afd_rows(a, attn, mc, ex, dev: str, ffn_info: list[dict], sync=None) -> dict:
    """Time the AFD attention worker for every ``(m, batch)`` of ``a.micro_batches`` x ``a.batch`` with the ready
    executor ``ex`` (its m set per run, its pipeline statistics reset; ``sync()`` before each, e.g. a barrier of
    the data-parallel attention workers); floor per step as in the module docstring, the FFN side counting the
    tokens of all ``ex.topo.num_attention`` workers' micro-batches as aggregated (one expert read per round).
    ``kv_bytes``: the largest KV cache this worker held."""
    from sglang.test.model_harness import ModelHarness

    backend = "triton" if a.device == "cuda" else "torch_native"
    parts = split_param_bytes(attn)
    bw = copy_bandwidth(dev)
    top_k, num_e = _moe_shape(mc)
    n_a = ex.topo.num_attention
    rows, kv_bytes = {}, 0
    for m in a.micro_batches:
        for b in a.batch:
            ex.m = m
            ex.reset_pipeline_stats()
            h = ModelHarness(attn, mc, b, _max_len(a), device=dev, attention_backend=backend)
            kv_bytes = max(kv_bytes, _kv_bytes(h.kv))
            if sync is not None:
                sync()
            times = _decode_times(h, b, a.input_len, a.steps, ex, mc.vocab_size, dev, a.decode_warmup)
            del h
            step = statistics.median(times)
            mb = -(-b // min(m, b))  # tokens of the largest micro-batch
            attn_floor = min(m, b) * parts["other"] / bw
            ffn_floor = max(min(m, b) * f["expert_bytes"] * touched_fraction(n_a * mb, top_k, num_e) / f["bw"]
                            for f in ffn_info)
            rows[(m, b)] = {"step_s": step, "tps": b / step, "floor_s": max(attn_floor, ffn_floor),
                            "attn_floor_s": attn_floor, "ffn_floor_s": ffn_floor,
                            "constraint": ex.pipeline_constraint()}
    return {"bw": bw, "rows": rows, "param_bytes": sum(parts.values()), "backend": backend, "kv_bytes": kv_bytes}


def _kv_bytes(pool) -> int:
    """Bytes of a harness KV pool (the server's pool or the per-layer tiny one)."""
    if hasattr(pool, "kv_size_bytes"):
        return pool.kv_size_bytes()
    return sum(t.numel() * t.element_size() for t in (*pool.k, *pool.v))


def _row(name: str, gpus: int, b: int, r: dict, colo_tps: float | None) -> str:
    per = r["tps"] / gpus
    ratio = f"{per / colo_tps:.2f}x" if colo_tps else "n/a"
    return (f"| {name} | {gpus} | {b} | {r['step_s'] * 1e3:.2f} | {r['tps']:.1f} | {per:.1f} | {ratio} | "
            f"{r['floor_s'] * 1e3:.2f} | {r['step_s'] / r['floor_s']:.1f}x |")


def decode_table(a, res: dict) -> list[str]:
    """Markdown lines of the decode results ``res`` (``{"colocated": measure_colocated(..), "afd": ...}``, either
    may be missing): one row per setup and batch, the pipeline check per AFD run, and the best-vs-best ratio
    against the 1.3x AFD target (per GPU; the colocated model on one GPU stands for replicas on all)."""
    gib, lines = 2**30, []
    colo, afd = res.get("colocated"), res.get("afd")
    if colo:
        lines.append(f"- colocated: ModelRunner ({colo['backend']} attention), CUDA graphs {colo['graphs']}; "
                     f"{colo['param_bytes'] / gib:.2f} GiB parameters; copy bandwidth {colo['bw'] / 1e12:.2f} TB/s; "
                     f"peak {colo['peak'] / gib:.2f} GiB")
    if afd:
        ffn = afd["ffn_info"]
        lines.append(f"- AFD: attention worker eager ({afd['backend']} attention) {afd['param_bytes'] / gib:.2f} GiB, "
                     f"copy bandwidth {afd['bw'] / 1e12:.2f} TB/s, peak {afd['peak'] / gib:.2f} GiB; FFN workers "
                     + ", ".join(f"{f['expert_bytes'] / gib:.2f} GiB ({f['bw'] / 1e12:.2f} TB/s)" for f in ffn))
        lines += [f"- {w['log']}; peak {w['peak'] / gib:.2f} GiB" for w in afd.get("workers", [])]
        lines += [f"- {f['log']}" for f in ffn if "log" in f]
        if afd.get("attention_workers", 1) > 1:
            lines.append(f"- AFD batch = requests per attention worker (data parallel): a step decodes "
                         f"{afd['attention_workers']} x batch tokens; tok/s sums the workers, step ms is the slowest")
    lines += ["- floor = parameter bytes a step reads / measured copy bandwidth (see benchmark/afd/decode_throughput.py)", "",
              "| setup | GPUs | batch | step ms | decode tok/s | tok/s per GPU | per-GPU ratio | floor ms | step/floor |",
              "|---|---|---|---|---|---|---|---|---|"]
    colo_rows = colo["rows"] if colo else {}
    for b, r in colo_rows.items():
        lines.append(_row("colocated", 1, b, r, r["tps"]))
    n_ffn = afd.get("ffn_workers", a.ffn_workers) if afd else a.ffn_workers
    n_attn = afd.get("attention_workers", 1) if afd else 1
    gpus = n_attn + n_ffn
    if afd:
        for (m, b), r in afd["rows"].items():
            base = colo_rows.get(b, {}).get("tps")
            lines.append(_row(f"AFD m={m}, {n_attn} attention + {n_ffn} FFN", gpus, b, r, base))
        lines += ["", "| m | batch | Ta ms | Tf ms | Tc ms | m >= 2(1+Tc/Tf) | attention floor ms | FFN floor ms |",
                  "|---|---|---|---|---|---|---|---|"]
        for (m, b), r in afd["rows"].items():
            c = r["constraint"]
            ok = "yes" if m >= c["m_min"] else "NO"
            lines.append(f"| {m} | {b} | {c['ta_ms']:.3f} | {c['tf_ms']:.3f} | {c['tc_ms']:.3f} | "
                         f"m >= 2(1+Tc/Tf) = {c['m_min']:.2f}: {ok} | {r['attn_floor_s'] * 1e3:.2f} | "
                         f"{r['ffn_floor_s'] * 1e3:.2f} |")
    if colo_rows and afd:
        cb = max(colo_rows, key=lambda k: colo_rows[k]["tps"])
        ab = max(afd["rows"], key=lambda k: afd["rows"][k]["tps"])
        ratio = afd["rows"][ab]["tps"] / gpus / colo_rows[cb]["tps"]
        lines += ["", f"Best vs best per GPU: AFD m={ab[0]} batch {ab[1]} {afd['rows'][ab]['tps'] / gpus:.1f} tok/s "
                      f"per GPU vs colocated batch {cb} {colo_rows[cb]['tps']:.1f} -> {ratio:.2f}x (target >= 1.3x: "
                      f"{'met' if ratio >= 1.3 else 'not met'})"]
    return lines


def decode_record(a, res: dict, env: dict | None = None, command: str | None = None) -> dict:
    """``--record-dir``: the decode results ``res`` (see :func:`decode_table`) as a :mod:`benchmark.common.records`
    record (``what`` = ``afd_decode``): one row per setup, m and batch with step ms, tok/s, tok/s per GPU, the
    colocated per-GPU tok/s of the same batch (the same-run baseline), the per-GPU ratio (> 1: AFD faster), the
    memory floor and step / floor. Headline: the table's best AFD vs best colocated tok/s per GPU."""
    from benchmark.common import records

    colo, afd = res.get("colocated") or {}, res.get("afd") or {}
    gpus = afd.get("attention_workers", 1) + afd.get("ffn_workers", a.ffn_workers)
    cols = {b: r["tps"] for b, r in colo.get("rows", {}).items()}
    keyed = [("colocated", 1, None, b, r) for b, r in colo.get("rows", {}).items()]
    keyed += [("afd", gpus, m, b, r) for (m, b), r in afd.get("rows", {}).items()]
    rows = [{"setup": s, "gpus": g, "m": m, "batch": b, "step_ms": r["step_s"] * 1e3, "tok_s": r["tps"],
             "tok_s_per_gpu": r["tps"] / g, "colocated_tok_s_per_gpu": cols.get(b), "floor_ms": r["floor_s"] * 1e3}
            for s, g, m, b, r in keyed]
    rows = records.add_ratio(records.add_ratio(rows, "per_gpu_ratio", "tok_s_per_gpu", "colocated_tok_s_per_gpu"),
                             "step_over_floor", "step_ms", "floor_ms")
    best = {s: max((r for r in rows if r["setup"] == s), key=lambda r: r["tok_s_per_gpu"], default=None)
            for s in ("colocated", "afd")}
    top = best["afd"] or best["colocated"]
    headline = [] if top is None else [{
        "label": f"decode tok/s per GPU, best {top['setup']} (m={top['m']}, batch {top['batch']})"
                 + (f" vs best colocated (batch {best['colocated']['batch']})" if best["afd"] and best["colocated"]
                    else ""), "value": round(top["tok_s_per_gpu"], 1), "unit": "tok/s",
        "baseline": round(best["colocated"]["tok_s_per_gpu"], 1) if best["afd"] and best["colocated"] else None,
        "ratio": round(top["tok_s_per_gpu"] / best["colocated"]["tok_s_per_gpu"], 3)
        if best["afd"] and best["colocated"] else None}]
    return records.make_record(
        subject="afd", benchmark="benchmark.afd.bench", mode="decode",
        what="afd_decode_smoke" if a.smoke else "afd_decode",
        rows=rows, params={k: getattr(a, k) for k in ("model_path", "load_format", "device", "batch", "input_len",
                                                      "steps", "ffn_workers", "attention_workers", "micro_batches")},
        baselines=["colocated_tok_s_per_gpu"] if rows else [],
        units={"step_ms": "ms", "floor_ms": "ms", "tok_s": "tok/s", "tok_s_per_gpu": "tok/s",
               "colocated_tok_s_per_gpu": "tok/s"},
        floor={"column": "floor_ms", "model": "parameter bytes a step reads / measured copy bandwidth"},
        headline=headline, gpu_count=(gpus if afd else 1) if a.device == "cuda" else 0, env=env, command=command)


def dump_results(res: dict, path: str) -> None:
    """Write ``res`` (see :func:`decode_table`) as JSON; AFD rows keyed ``"m,batch"``."""
    import json

    out = dict(res)
    if "afd" in out:
        out["afd"] = dict(out["afd"], rows={f"{m},{b}": r for (m, b), r in out["afd"]["rows"].items()})
    with open(path, "w") as f:
        json.dump(out, f)


def load_results(paths: list[str]) -> dict:
    """The union of :func:`dump_results` files (a later file's setup replaces an earlier one's), keys restored.
    Raises ValueError for a file without decode results."""
    import json

    res: dict = {}
    for p in paths:
        with open(p) as f:
            got = json.load(f)
        if not set(got) & {"colocated", "afd"}:
            raise ValueError(f"--merge {p}: no colocated or afd results in it")
        res.update(got)
    if "colocated" in res:
        res["colocated"]["rows"] = {int(k): v for k, v in res["colocated"]["rows"].items()}
    if "afd" in res:
        res["afd"]["rows"] = {tuple(int(x) for x in k.split(",")): v for k, v in res["afd"]["rows"].items()}
    return res
