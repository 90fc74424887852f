"""The model runner's DP-attention branches on CPU (one rank, a fake CUDA-graph runner that records replays): an
``IDLE`` batch runs the idle forward (or replays the agreed graph with padding only) and samples nothing; a decode
batch replays exactly the graph size every rank agreed on, and runs eagerly when the agreement says so even though a
graph would fit locally; the MoE padding follows the agreed step; the decode-input stager takes an empty batch."""

from __future__ import annotations

import torch

from conftest import shared_path
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.deployment.plan import DpAttentionSpec
from sglang.srt.distributed.communicator import TorchCommunicator
from sglang.srt.dp_attention.moe import DpGatheredFusedMoE
from sglang.srt.dp_attention.rank import DpAttentionRank
from sglang.srt.dp_attention.step_sync import DpGlobalStep
from sglang.srt.forward_batch_info import ForwardMode, ModelWorkerBatch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.model_executor.graph_inputs import DecodeInputStager
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs


class OneRankDp(DpAttentionRank):
    """A DP world of one rank (collectives are identities), counting idle forwards."""

    def __init__(self):
        super().__init__(DpAttentionSpec(0, 1, 1), None, None, TorchCommunicator(None, 0, 1))
        self.idle_runs = 0

    def agree_min(self, value: int) -> int:
        return value

    def run_idle(self, model, dtype, device, step=None) -> None:
        self.idle_runs += 1
        super().run_idle(model, dtype, device, step)


class FakeGraphs:
    max_bs = 8
    batch_sizes = [1, 2, 4, 8]

    def __init__(self, vocab: int):
        self.vocab, self.replays, self.graphs, self.greedy_reads = vocab, [], {b: None for b in self.batch_sizes}, []

    def padded_size(self, bs):
        return next(b for b in self.batch_sizes if b >= bs)

    def can_run(self, batch):
        return batch.forward_mode == ForwardMode.DECODE and 1 <= batch.batch_size <= self.max_bs

    def replay(self, batch, padded=None):
        self.replays.append((batch.batch_size, padded))
        return LogitsProcessorOutput(next_token_logits=torch.zeros(batch.batch_size, self.vocab))

    def greedy_ids(self, batch, padded=None):
        self.greedy_reads.append(padded)
        return None


def _runner():
    path = shared_path("models", "stories260K-moe8")
    dp = OneRankDp()
    r = ModelRunner(ModelConfig.from_path(path), ServerArgs(model_path=path, device="cpu", max_total_tokens=256),
                    "cpu", dp_attention=dp)
    return r, dp


def _decode_batch(runner, n: int, step) -> ModelWorkerBatch:
    reqs = []
    for i in range(n):
        p = SamplingParams(temperature=0.0, max_new_tokens=4)
        p.normalize(None)
        reqs.append(Req(f"r{i}", [1, 2, 3], p))
    rows = [runner.kv_cache.alloc_req_slot() for _ in range(n)]
    return ModelWorkerBatch(forward_mode=ForwardMode.DECODE, input_ids=[5] * n, positions=[0] * n,
                            out_cache_loc=torch.arange(1, n + 1), req_pool_indices=rows, prefix_lens=[0] * n,
                            extend_lens=[1] * n, seq_lens=[1] * n, sample=[True] * n, top_logprobs_nums=[0] * n,
                            sampling_info=runner.make_sampling_info(reqs), dp_step=step)


def _idle_batch(step) -> ModelWorkerBatch:
    return ModelWorkerBatch(forward_mode=ForwardMode.IDLE, input_ids=[], positions=[], out_cache_loc=torch.empty(0),
                            req_pool_indices=[], prefix_lens=[], extend_lens=[], seq_lens=[], sample=[], dp_step=step)


def test_runner_follows_the_agreed_step():
    runner, dp = _runner()
    blocks = [layer.mlp for layer in runner.model.decoder_layers]
    assert all(isinstance(b.experts, DpGatheredFusedMoE) for b in blocks) and dp.lockstep
    vocab = runner.model_config.vocab_size

    # idle, eager: the MoE layers' collectives run with no rows, nothing is sampled
    logits, sample = runner.forward(_idle_batch(DpGlobalStep((0, 9), True, 0)))
    assert dp.idle_runs == 1 and logits.next_token_logits.shape == (0, vocab) and sample.next_token_ids.numel() == 0
    assert dp.padding.rows == 9  # the MoE all-gathers pad to the largest rank's tokens

    graphs = runner.cuda_graph_runner = FakeGraphs(vocab)
    # idle while the others replay size 4: the same graph, padding rows only
    runner.forward(_idle_batch(DpGlobalStep((0, 3), True, 4)))
    assert graphs.replays == [(0, 4)] and dp.idle_runs == 1 and dp.padding.rows == 4

    # a decode of 2 replays the agreed 4 (not its own padded 2)
    _, sample = runner.forward(_decode_batch(runner, 2, DpGlobalStep((2, 3), True, 4)))
    assert graphs.replays[-1] == (2, 4) and sample.next_token_ids.shape == (2,)
    assert graphs.greedy_reads == [4]  # the argmax of the graph that was replayed, not of size 2's

    # another rank runs a prefill this step: eager here too, though a graph would fit this decode
    logits, sample = runner.forward(_decode_batch(runner, 2, DpGlobalStep((2, 40), True, 0)))
    assert len(graphs.replays) == 2 and dp.padding.rows == 40
    assert logits.next_token_logits.shape == (2, vocab) and logits.next_token_logits.abs().sum() > 0


def test_graph_greedy_ids_read_the_replayed_graph():
    """A decode of 2 replayed in the agreed graph of 4 reads that graph's captured argmax (size 2's holds another
    step's tokens)."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

    runner, _ = _runner()
    batch = _decode_batch(runner, 2, None)
    fake = SimpleNamespace(greedy_outputs={2: torch.tensor([20, 21]), 4: torch.tensor([40, 41, 42, 43])},
                           padded_size=lambda bs: 2)
    assert CudaGraphRunner.greedy_ids(fake, batch, 4).tolist() == [40, 41]
    assert CudaGraphRunner.greedy_ids(fake, batch).tolist() == [20, 21]


def test_decode_stager_takes_an_empty_batch():
    st = DecodeInputStager(8, pad_req_idx=7, device="cpu")
    st.stage(_idle_batch(None), 4)
    assert st.static[:, :4].tolist() == [[0] * 4, [0] * 4, [7] * 4, [1] * 4, [0] * 4]
