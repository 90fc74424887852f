"""The AFD attention worker's decode step as one CUDA graph (``benchmark/afd/bench_step_graph.py``; MegaScale-Infer, Zhu et al.
2025, sec. 4.1 + 5): :class:`StepGraph` captures ``AfdExecutor.run`` of one decode :class:`ForwardBatch` -- every
layer's attention and dense parts plus the device-driven M2N sends / receives of every (layer, micro-batch) (see
:mod:`sglang.srt.afd.device_m2n`) -- and replays it with fresh inputs copied into the captured batch's tensors,
as the server's :class:`~sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner` does (which captures the same
``run`` for an executor with ``graph_captures_executor``).
"""

from __future__ import annotations

import torch

DECODE_FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "prefix_lens",
                 "extend_lens", "extend_start_loc")


def load_inputs(static, fb) -> None:
    """Copy decode batch ``fb``'s tensors into ``static``'s (same batch size and requests order) and take its
    ``*_cpu`` lists (a captured decode graph reads only the tensors; the lists keep ``static`` right for an eager
    run). Raises ValueError on another batch size or mode."""
    if fb.batch_size != static.batch_size or fb.forward_mode != static.forward_mode:
        raise ValueError(f"batch of {fb.batch_size} ({fb.forward_mode}) does not fit the graph of "
                         f"{static.batch_size} ({static.forward_mode})")
    for name in DECODE_FIELDS:
        getattr(static, name).copy_(getattr(fb, name))
    for name in ("seq_lens_cpu", "prefix_lens_cpu", "extend_lens_cpu", "req_pool_indices_cpu"):
        setattr(static, name, list(getattr(fb, name)))


class StepGraph:
    """One captured decode step of ``executor`` (device-driven AFD; ``executor.graph_captures_executor``) over
    ``model`` for the decode batch ``fb`` (its tensors become the graph's static inputs).

    ``warmup`` eager runs first (Triton JIT, the peers' mapping; each is a real step with the FFN workers), then the
    capture on a side stream. :meth:`replay` announces the step, replays, fails closed (synchronizes) and returns
    the static logits ``[bs, vocab]`` fp32 (valid until the next replay).
    Raises: RuntimeError from the capture (e.g. an op that synchronizes); the executor's errors from a step.
    """

    def __init__(self, executor, model, fb, warmup: int = 2):
        if not getattr(executor, "graph_captures_executor", False):
            raise ValueError("StepGraph needs a device-driven AFD executor (--afd-transport cuda_push or cuda_push_ll)")
        self.ex, self.fb = executor, fb
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode():
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    executor.run(model, fb)
            stream.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=stream):
                self.logits = executor.run(model, fb).next_token_logits
        torch.cuda.synchronize()

    def replay(self, fb=None) -> torch.Tensor:
        """One step (``fb``: new inputs of the same batch shape, copied in first)."""
        if fb is not None:
            load_inputs(self.fb, fb)
        self.ex.before_graph_replay(self.fb.batch_size)
        self.graph.replay()
        self.ex.after_graph_replay()
        return self.logits
