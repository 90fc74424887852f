"""Two-batch overlap on GPUs.

One GPU (stories260K-moe8, fp32, Triton attention, a ModelRunner with decode CUDA graphs up to batch 16):

1. The two-stream schedule gives the sequential executor's greedy tokens. Every norm gets a world-1 communicator
   whose "all-reduce" first sleeps on the stream it is issued on (``torch.cuda._sleep``), so the norm stages are
   communication stages, run on the executor's communication stream, and run long: a missing event wait or a
   buffer reused across streams too early shows up as wrong tokens. Forced on (every batch of >= 2 tokens splits),
   so the decode graphs capture the two-micro-batch schedule (``graph_captures_executor``) and replay it.
2. Replaying those graphs equals the eager two-stream forward on the same runner, batch by batch (captured and
   padded sizes).

Two GPUs: TP 2 / EP 2 over NCCL (the all-reduce expert parallelism), the overlap forced on, gives the unsplit
executor's tokens and the CPU TP1 tokens (``tbo_worker.tbo_greedy_many`` on ``cuda`` ranks).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO / "test" / "unit"))
from conftest import shared_path  # noqa: E402

pytestmark = pytest.mark.gpu

GRAPH_TOL = 2e-3  # fp32: graph replay vs eager differ only by padding rows' GEMM shapes
SLEEP_CYCLES = 200_000  # ~0.1 ms per "collective" on a ~2 GHz SM clock


def _slow_local_comm():
    from sglang.srt.distributed.communicator import Communicator

    class SlowLocalCommunicator(Communicator):
        """World 1 (every collective is the identity) whose all-reduce sleeps on the current stream first and
        returns a new tensor allocated there, as a real collective's output is; records the streams it ran on."""

        name = "slow_local"

        def __init__(self):
            super().__init__(0, 1)
            self.streams: set = set()

        def all_reduce(self, x):
            if x.is_cuda:  # (CPU: the helpers' dry run, no streams)
                self.streams.add(torch.cuda.current_stream(x.device).cuda_stream)
                torch.cuda._sleep(SLEEP_CYCLES)
            return x.clone()

        def all_gather(self, x, dim=-1):
            return x

        def reduce_scatter(self, x):
            return x

    return SlowLocalCommunicator()


def _runner(executor, comm, graphs: bool = True, device: str = "cuda:0"):
    """A ModelRunner on ``device`` over stories260K-moe8 with ``executor`` (None: the plan's sequential one); every
    residual norm gets ``comm``; then decode graphs up to 16 (captured after the norms are set; CUDA only)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    path = shared_path("models", "stories260K-moe8")
    kind = device.split(":")[0]
    args = ServerArgs(model_path=path, device=kind, attention_backend="triton" if kind == "cuda" else "torch_native",
                      max_total_tokens=4096, max_running_requests=16, disable_cuda_graph=True, cuda_graph_max_bs=16)
    r = ModelRunner(ModelConfig.from_path(path, None, "auto", kind), args, device, executor=executor)
    for layer in r.model.decoder_layers:
        layer.input_layernorm.comm = comm
        layer.post_attention_layernorm.comm = comm
    r.model.model.norm.comm = comm
    if graphs and kind == "cuda":
        r.cuda_graph_runner = CudaGraphRunner(r, 16, r.pad_req_idx)
    return r


class RunnerDriver:
    """``step(items, executor=None) -> logits [bs, V]`` over a ModelRunner (the ``tbo_worker.run_schedule``
    harness interface; the runner's own executor and graphs run). ``replays`` counts graph replays."""

    def __init__(self, runner):
        self.r, self.rows, self.lens, self.replays = runner, {}, {}, 0
        gr = runner.cuda_graph_runner
        if gr is not None:
            real = gr.replay

            def spy(batch, padded=None):  # the runner passes the agreed padded size (None: its own choice)
                self.replays += 1
                return real(batch, padded)
            gr.replay = spy

    def batch(self, items):
        from sglang.srt.forward_batch_info import ForwardMode, ModelWorkerBatch
        from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
        from sglang.srt.sampling.sampling_params import SamplingParams

        r = self.r
        ids, pos, rows, prefix, ext = [], [], [], [], []
        for rid, new in items:
            if rid not in self.rows:
                self.rows[rid], self.lens[rid] = r.req_to_token_pool.alloc(1)[0], 0
            p = self.lens[rid]
            ids += new
            pos += range(p, p + len(new))
            rows.append(self.rows[rid])
            prefix.append(p)
            ext.append(len(new))
        locs = r.allocator.alloc(len(ids))
        off = 0
        for (rid, new), row in zip(items, rows):
            r.req_to_token_pool.write(row, self.lens[rid], locs[off:off + len(new)])
            self.lens[rid] += len(new)
            off += len(new)
        dec = [e == 1 and p > 0 for p, e in zip(prefix, ext)]
        mode = ForwardMode.DECODE if all(dec) else ForwardMode.MIXED if any(dec) else ForwardMode.EXTEND
        params = []
        for _ in items:
            sp = SamplingParams(temperature=0.0, max_new_tokens=8)
            sp.normalize(None)
            params.append(sp)
        info = SamplingBatchInfo.from_reqs(params, r.device, r.model_config.vocab_size, [[] for _ in items])
        return ModelWorkerBatch(forward_mode=mode, input_ids=ids, positions=pos, out_cache_loc=locs,
                                req_pool_indices=rows, prefix_lens=prefix, extend_lens=ext,
                                seq_lens=[p + e for p, e in zip(prefix, ext)], sample=[True] * len(items),
                                top_logprobs_nums=[0] * len(items), sampling_info=info)

    def run(self, batch, use_graphs: bool = True) -> torch.Tensor:
        saved = self.r.cuda_graph_runner
        if not use_graphs:
            self.r.cuda_graph_runner = None
        try:
            logits_out, _ = self.r.forward(batch)
            return logits_out.next_token_logits.float().clone()
        finally:
            self.r.cuda_graph_runner = saved

    def step(self, items, executor=None, poison: bool = True) -> torch.Tensor:
        return self.run(self.batch(items))


def _forced(graph_max_bs: int = 16, device: str = "cuda:0"):
    from sglang.srt.two_batch_overlap.auto_off import Threshold
    from sglang.srt.two_batch_overlap.executor import TboConfig, TwoBatchOverlapExecutor

    return TwoBatchOverlapExecutor(TboConfig(threshold=Threshold(2, False, "forced on by the test"),
                                             graph_max_bs=graph_max_bs), device)


def test_two_streams_and_decode_graphs_give_sequential_tokens():
    from tbo_worker import N_NEW, prompt_ids, run_schedule

    path = shared_path("models", "stories260K-moe8")
    prompts = [list(p) for p in prompt_ids(path)]
    ex, comm = _forced(), _slow_local_comm()
    tbo = RunnerDriver(_runner(ex, comm))
    assert ex.graph_captures_executor and tbo.r.cuda_graph_runner.staged is ex
    splits: dict = {}

    def count(_):
        s = ex.last_split
        k = "unsplit" if s is None else s.by
        splits[k] = splits.get(k, 0) + 1
    got = run_schedule(tbo, None, prompts, N_NEW, chunk=3, on_step=count)
    ref = RunnerDriver(_runner(None, _slow_local_comm()))
    want = run_schedule(ref, None, prompts, N_NEW, chunk=3)
    assert got == want
    assert ex.comm_stream.cuda_stream in comm.streams  # the norm stages ran on the communication stream
    assert tbo.replays > 0 and splits.get("tokens", 0) > 0 and splits.get("requests", 0) > 0, (tbo.replays, splits)


def test_graph_replay_of_the_split_schedule_matches_eager():
    ex = _forced()
    drv = RunnerDriver(_runner(ex, _slow_local_comm()))
    gen = torch.Generator().manual_seed(11)
    rids = list(range(16))
    drv.step([(i, torch.randint(3, 512, (int(torch.randint(4, 20, (1,), generator=gen)),), generator=gen).tolist())
              for i in rids])
    for size in (2, 3, 8, 13, 16, 1, 5):
        sel = rids[:size]
        items = [(i, torch.randint(3, 512, (1,), generator=gen).tolist()) for i in sel]
        batch = drv.batch(items)
        before = drv.replays
        graph = drv.run(batch)
        assert drv.replays == before + 1, f"decode batch {size} did not replay a graph"
        eager = drv.run(batch, use_graphs=False)  # same KV slots: the writes are idempotent
        assert (ex.last_split is not None) == (size >= 2)
        torch.testing.assert_close(graph, eager, rtol=GRAPH_TOL, atol=GRAPH_TOL * max(1.0, eager.abs().max().item()))
        assert torch.equal(graph.argmax(-1), eager.argmax(-1))


def test_tp2_ep2_nccl_overlap_gives_tp1_tokens():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from tbo_worker import N_NEW, prompt_ids, tbo_greedy_many, tp1_greedy
    from tp_worker import spawn_ranks

    path = shared_path("models", "stories260K-moe8")
    configs = [dict(executor="sequential", chunk=3), dict(executor="tbo", threshold=0.48, chunk=3),
               dict(executor="tbo", threshold=0.48, chunk=None)]
    ranks = spawn_ranks(tbo_greedy_many, 2, path, [list(p) for p in prompt_ids(path)], N_NEW, configs,
                        device="cuda", timeout=600)
    want = [list(t) for t in tp1_greedy(path)]
    for results in ranks:
        assert [r["tokens"] for r in results] == [want] * len(configs)
    assert ranks[0][1]["stats"].get("by_tokens", 0) > 0 and ranks[0][1]["stats"].get("by_requests", 0) > 0
