"""The decode CUDA graphs the decode benchmarks measure: a
:class:`~sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner` capturing exactly the measured batch sizes (its
graphs kept so their nodes can be counted), the node count by type of one captured graph, and the GPU time of a graph
replayed alone (CUDA events, median).

Shared by :mod:`benchmark.decode.step_ab`, :mod:`benchmark.decode.switch_ab`, :mod:`benchmark.decode.gemm_ab` and
:mod:`benchmark.quantization.bench_fp8`, so none of them imports another's entry point.
"""

from __future__ import annotations

import collections
import ctypes
import logging
from typing import Optional

import torch

__all__ = ["NODE_TYPES", "graph_node_counts", "capture_graphs", "replay_only_ms"]

logger = logging.getLogger(__name__)
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait", 7: "record"}


def graph_node_counts(graph) -> Optional[dict]:
    """``{"total": n, "kernel": k, ...}`` of a graph captured with ``keep_graph=True``; None when unavailable."""
    try:
        handle = ctypes.c_void_p(graph.raw_cuda_graph())
        lib = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_size_t(0)
        if lib.cuGraphGetNodes(handle, None, ctypes.byref(n)) != 0:
            return None
        nodes = (ctypes.c_void_p * n.value)()
        if lib.cuGraphGetNodes(handle, nodes, ctypes.byref(n)) != 0:
            return None
        kinds = collections.Counter()
        for node in nodes:
            t = ctypes.c_int(-1)
            lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t))
            kinds[NODE_TYPES.get(t.value, str(t.value))] += 1
        return {"total": int(n.value), **kinds}
    except Exception as e:  # older torch (no keep_graph/raw_cuda_graph) or no driver library
        logger.warning("graph node count unavailable: %s: %s", type(e).__name__, e)
        return None


def capture_graphs(runner, sizes: list[int]):
    """A CudaGraphRunner capturing exactly ``sizes`` (graphs kept for node counts)."""
    from sglang.srt.model_executor import cuda_graph_runner as cgr

    orig_sizes, orig_graph = cgr.capture_batch_sizes, torch.cuda.CUDAGraph

    def keep_graph():
        try:
            return orig_graph(keep_graph=True)
        except TypeError:
            return orig_graph()

    cgr.capture_batch_sizes = lambda max_bs: list(sizes)
    torch.cuda.CUDAGraph = keep_graph
    try:
        g = cgr.CudaGraphRunner(runner, max(sizes), runner.pad_req_idx)
    finally:
        cgr.capture_batch_sizes, torch.cuda.CUDAGraph = orig_sizes, orig_graph
    for graph in g.graphs.values():
        if hasattr(graph, "instantiate"):
            try:
                graph.instantiate()
            except Exception as e:  # already instantiated (keep_graph unsupported): replay works as is
                logger.info("graph.instantiate(): %s: %s", type(e).__name__, e)
    return g


def replay_only_ms(graphs, bs: int, reps: int = 10) -> float:
    """GPU ms of the padded-``bs`` graph replayed back to back (inputs as last copied in), median of ``reps``."""
    from benchmark.common.timing import time_cuda_events

    graph = graphs.graphs[graphs.padded_size(bs)]
    torch.cuda.synchronize()
    return time_cuda_events(graph.replay, iters=reps, warmup=0).median_ms
