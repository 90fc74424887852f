"""Host time of one decode step around the graph replay, old vs new, on the CPU (no GPU needed).

Measures, per batch size, the median over ``--iters`` calls (after warm-up) of:

* ``sampling_info``: ``ModelRunner.make_sampling_info`` for the batch's requests: ``build`` = a fresh
  :class:`~sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo` every step (the path before the host-path rework),
  ``reuse`` = the same requests asking again (the step-independent cache);
* ``stage``: the CUDA graphs' static decode inputs: ``legacy`` = clone a pad tensor, a tensor from the lists, (on
  CUDA: pin), copy, then a second copy for the KV slots (before the host-path rework); ``packed`` =
  :class:`~sglang.srt.model_executor.graph_inputs.DecodeInputStager` (numpy writes into a persistent buffer, one copy);
* ``step_host``: ``bench_one_batch``'s ``StaticBatch.step`` with the forward replaced by a stub returning fixed ids
  (KV slot allocation, ``req_to_token`` write, batch building, sampling info, ``.tolist()``), i.e. the host work
  of one CLI decode step outside the model, with the sampling-info reuse on and off.

On a CUDA device (``--device cuda``) the staging copies are real host-to-device copies (pinned for ``packed``);
the stub forward is the same. The model is the tiny ``stories260K`` Llama (its size does not enter these numbers).

Usage (repo root)::

    python benchmark/decode/host_step.py [--batches 1,32,128] [--iters 200] [--device cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _path in (REPO / "python", REPO):  # the sglang package; the benchmark package (records)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
del _path

import torch  # noqa: E402

MODEL = REPO.parent / "shared" / "data" / "models" / "stories260K"


def median_us(fn, iters: int, warmup: int = 10, sync=None) -> float:
    """Median wall time of ``fn()`` in microseconds (``sync()`` after each call when given)."""
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def build_runner(device: str, max_bs: int):
    """A ModelRunner of the tiny Llama on ``device`` with room for ``max_bs`` requests (graphs off)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=str(MODEL), device=device, max_total_tokens=max_bs * 512 + 4096,
                    max_running_requests=max_bs + 1, disable_cuda_graph=True, context_length=512)
    return ModelRunner(ModelConfig.from_path(sa.model_path, sa.context_length, sa.dtype, device), sa, device)


def fake_decode_batch(bs: int, gen: torch.Generator, device: torch.device, vocab: int):
    """A decode ModelWorkerBatch of ``bs`` rows with list columns and device KV slots."""
    from sglang.srt.forward_batch_info import ForwardMode, ModelWorkerBatch

    pos = torch.randint(100, 1000, (bs,), generator=gen).tolist()
    return ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE, input_ids=torch.randint(0, vocab, (bs,), generator=gen).tolist(),
        positions=pos, out_cache_loc=torch.randint(1, 10000, (bs,), generator=gen).to(device),
        req_pool_indices=list(range(bs)), prefix_lens=pos, extend_lens=[1] * bs, seq_lens=[p + 1 for p in pos],
        sample=[True] * bs, top_logprobs_nums=[0] * bs)


def bench_stage(bs: int, iters: int, device: torch.device, gen) -> dict:
    """Legacy vs packed staging of one decode batch of ``bs`` rows (padded to the next multiple of 8)."""
    from sglang.srt.model_executor.graph_inputs import DecodeInputStager, stage_decode_inputs_legacy

    max_bs, padded = 160, min(160, -(-bs // 8) * 8)
    batch = fake_decode_batch(bs, gen, device, 32000)
    stager = DecodeInputStager(max_bs, 0, device)
    static = torch.zeros(5, max_bs, dtype=torch.int64, device=device)
    pad = torch.tensor([[0], [0], [0], [1]], dtype=torch.int64).expand(4, max_bs).contiguous()
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    out = {}
    for rep in range(2):  # alternate the order
        for name in (("legacy", "packed") if rep == 0 else ("packed", "legacy")):
            fn = (lambda: stage_decode_inputs_legacy(static, pad, batch, padded)) if name == "legacy" else \
                (lambda: stager.stage(batch, padded))
            out.setdefault(name, []).append(median_us(fn, iters // 2, sync=sync))
    return {k: statistics.median(v) for k, v in out.items()}


def bench_sampling(runner, bs: int, iters: int) -> dict:
    """Fresh SamplingBatchInfo per step vs the reused one, for ``bs`` greedy requests."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.model_executor.model_runner import build_sampling_info
    from sglang.srt.sampling.sampling_params import SamplingParams

    vocab = runner.model_config.vocab_size
    reqs = []
    for i in range(bs):
        p = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
        p.normalize(None)
        reqs.append(Req(f"host-{bs}-{i}", [1] * 16, p))
    runner.make_sampling_info(reqs)
    return {"build": median_us(lambda: build_sampling_info(reqs, runner.device, vocab), iters),
            "reuse": median_us(lambda: runner.make_sampling_info(reqs), iters)}


def bench_step(runner, bs: int, iters: int, reuse: bool) -> float:
    """Host time of StaticBatch.step (decode) with a stub forward; ``reuse`` False rebuilds the sampling info."""
    from sglang.bench_one_batch import StaticBatch
    from sglang.srt.layers.sampler import SamplerOutput
    from sglang.srt.model_executor.model_runner import build_sampling_info

    vocab = runner.model_config.vocab_size
    ids = torch.zeros(bs, dtype=torch.int64, device=runner.device)
    orig_forward, orig_make = runner.forward, runner.make_sampling_info
    runner.forward = lambda batch: (None, SamplerOutput(next_token_ids=ids))
    if not reuse:
        runner.make_sampling_info = lambda reqs: build_sampling_info(reqs, runner.device, vocab)
    batch = StaticBatch(runner, [[1] * 8 for _ in range(bs)], iters + 32)
    try:
        batch.prefill([[1] * 8 for _ in range(bs)], None)
        return median_us(lambda: batch.step([[1]] * bs), iters)
    finally:
        batch.free()
        runner.forward, runner.make_sampling_info = orig_forward, orig_make
        del runner.forward, runner.make_sampling_info  # back to the class methods


def main(argv=None) -> int:
    """Run the three measurements per batch size; print a table, write ``decode_host.{md,json}`` under ``--out``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None)
    from benchmark.common.records import add_record_dir_argument
    add_record_dir_argument(p, "decode")
    cfg = p.parse_args(argv)
    batches = [int(b) for b in cfg.batches.split(",") if b.strip()]
    if not batches or min(batches) < 1 or max(batches) > 160 or cfg.iters < 4:
        raise SystemExit("--batches must be in 1..160 and --iters >= 4")
    torch.set_num_threads(1)
    device = torch.device(cfg.device)
    runner = build_runner(cfg.device, max(batches))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bs in batches:
        r = {"batch": bs, **{f"stage_{k}_us": v for k, v in bench_stage(bs, cfg.iters, device, gen).items()},
             **{f"sampling_{k}_us": v for k, v in bench_sampling(runner, bs, cfg.iters).items()},
             "step_host_old_us": bench_step(runner, bs, cfg.iters, reuse=False),
             "step_host_new_us": bench_step(runner, bs, cfg.iters, reuse=True)}
        rows.append(r)
    host = platform.processor() or platform.machine()
    head = (f"Decode host time per step, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, device "
            f"{cfg.device} ({torch.cuda.get_device_name(0) if device.type == 'cuda' else host}), 1 CPU thread, "
            f"medians of {cfg.iters} calls, us")
    lines = [head, "", "| batch | stage legacy | stage packed | sampling build | sampling reuse | "
             "CLI step host old | CLI step host new |", "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['stage_legacy_us']:.1f} | {r['stage_packed_us']:.1f} | "
              f"{r['sampling_build_us']:.1f} | {r['sampling_reuse_us']:.1f} | {r['step_host_old_us']:.1f} | "
              f"{r['step_host_new_us']:.1f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_host.md").write_text(text)
        (out / "decode_host.json").write_text(json.dumps({"header": head, "rows": rows}, indent=1))
    if cfg.record_dir:
        write_host_record(rows, cfg, Path(cfg.record_dir))
    return 0


def write_host_record(rows: list[dict], cfg, results_root: Path) -> Path:
    """The rows as a :mod:`benchmark.common.records` record (``what`` = ``host_step``), with the old paths as the
    same-run baselines and new / old ratios; returns the JSON path."""
    from benchmark.common import records

    rows = records.add_ratio(rows, "step_new_over_old", "step_host_new_us", "step_host_old_us")
    rows = records.add_ratio(rows, "stage_packed_over_legacy", "stage_packed_us", "stage_legacy_us")
    big = max(rows, key=lambda r: r["batch"])
    rec = records.make_record(
        subject="decode", benchmark="benchmark.decode.bench", mode="host", what="host_step", rows=rows,
        params={"device": cfg.device, "iters": cfg.iters, "threads": 1},
        baselines=("step_host_old_us", "stage_legacy_us", "sampling_build_us"),
        units={k: "us" for k in rows[0] if k.endswith("_us")},
        headline=[{"label": f"host time of a decode step around the replay, batch {big['batch']} ({cfg.device})",
                   "value": round(big["step_host_new_us"], 1), "unit": "us",
                   "baseline": round(big["step_host_old_us"], 1), "ratio": big["step_new_over_old"]}],
        gpu_count=None if cfg.device.startswith("cuda") else 0)
    js, _ = records.write_record(rec, results_root)
    sys.stdout.write(f"record: {js}\n")
    return js


if __name__ == "__main__":
    sys.exit(main())
