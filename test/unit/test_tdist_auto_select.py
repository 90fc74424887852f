"""``--enable-tdist-overlap`` turns its sequence-parallel layout off where it loses: the threshold read
off the calibration tables (the 4 x H200 table puts Llama-3.3-70B TP4 at 8192 tokens, where the measured stack went
from 0.992x at 4096 to 1.091x), the conservative defaults (GPUs without a table, torch collectives, Triton-kernel
producers), and on gloo CPU ranks (stories260K, TP 2) the executor switching exactly at the threshold per forward
with greedy tokens equal to the single process's and logits within the TP tolerance on both sides."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from conftest import shared_path  # noqa: E402
from test_tp_models import ATOL, RTOL  # noqa: E402
from tp_worker import harness_for, spawn_ranks  # noqa: E402

from sgl_kernel.tdist.auto import H100_TABLE, H200_TABLE, NEVER, CalibrationTable  # noqa: E402
from sglang.srt.model_executor.executors.sequence_parallel_select import (  # noqa: E402
    DECOMP_SHARE, NEVER_TOKENS, UNKNOWN_GPU_MIN_TOKENS, auto_min_tokens, decomp_share, layer_gemm_shapes,
    min_tokens_from_table)

# Llama-3.3-70B at TP 4 per rank: qkv (AG), o_proj (RS), gate_up (AG), down (RS); 80 layers repeat them
LLAMA70_TP4 = [("ag", 8192, 2560), ("rs", 2048, 8192), ("ag", 8192, 14336), ("rs", 7168, 8192)] * 3


def test_h200_table_puts_the_70b_stack_at_8192_tokens():
    assert decomp_share(LLAMA70_TP4, H200_TABLE, 4, 4095) < DECOMP_SHARE  # only gate_up: ~55%
    assert decomp_share(LLAMA70_TP4, H200_TABLE, 4, 4096) == pytest.approx(117440512 / 213909504)
    assert decomp_share(LLAMA70_TP4, H200_TABLE, 4, 8192) > 0.9  # qkv, gate_up, down
    assert min_tokens_from_table(LLAMA70_TP4, H200_TABLE, 4) == 8192
    assert min_tokens_from_table(LLAMA70_TP4, H100_TABLE, 2) == 8192  # qkv + gate_up at 2048: 65%
    assert min_tokens_from_table(LLAMA70_TP4, H100_TABLE, 2, share=0.6) == 2048
    assert min_tokens_from_table(LLAMA70_TP4, CalibrationTable(default_min_m=1024), 4) == 1024


def test_threshold_needs_the_share_at_every_larger_size():
    # the decomposition wins at 2048 and 8192 but not at 4096 in between: the layout only from 8192
    t = CalibrationTable(best=(("ag", 64, 64, 2, 2048, "decomp"), ("ag", 64, 64, 2, 4096, "nccl"),
                               ("ag", 64, 64, 2, 8192, "decomp")))
    assert min_tokens_from_table([("ag", 64, 64)], t, 2) == 8192
    never = CalibrationTable((("ag", 64, 64, 2, NEVER),))
    assert min_tokens_from_table([("ag", 64, 64)], never, 2) == NEVER_TOKENS
    with pytest.raises(ValueError, match="share"):
        min_tokens_from_table([("ag", 64, 64)], never, 2, share=0.0)


def _stories_model():
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import load_model

    return load_model(ModelConfig.from_path(shared_path("models", "stories260K")), "auto", "cpu")


def test_auto_min_tokens_per_ops_kind():
    model = _stories_model()
    shapes = layer_gemm_shapes(model)
    assert {s[0] for s in shapes} == {"ag", "rs"} and len(shapes) == 4 * len(model.decoder_layers)
    torch_ops = SimpleNamespace(name="torch", rank=0, world_size=2)
    assert auto_min_tokens(model, torch_ops) == NEVER_TOKENS  # nothing to overlap: always sequential
    measured = CalibrationTable(tuple((kind, k, n, 2, 300) for kind, k, n in set(shapes)))
    fused = SimpleNamespace(name="tdist", producer="decomp", rank=0, world_size=2, table=measured)
    assert auto_min_tokens(model, fused) == 300  # a measured table decides, also below the unknown-GPU default
    unknown = SimpleNamespace(name="tdist", producer="decomp", rank=0, world_size=2, table=None,
                              heap=SimpleNamespace(device=torch.device("cpu")))
    assert auto_min_tokens(model, unknown) == UNKNOWN_GPU_MIN_TOKENS  # default table says 4096: raised
    kernels = SimpleNamespace(name="tdist", producer="ce", rank=0, world_size=2, table=measured)
    assert auto_min_tokens(model, kernels) == UNKNOWN_GPU_MIN_TOKENS


MIN_TOKENS = 9
# (request, new tokens): prefills of 8 (below: sequential), 9 (at: layout), 12 (above: layout); decode steps of 1-3
BATCHES = [[("a", list(range(3, 11)))], [("b", list(range(20, 29)))], [("a", [40]), ("b", [41])],
           [("c", list(range(50, 62)))], [("a", [42]), ("b", [43]), ("c", [44])]]


def selected_logits(ps, path: str, min_tokens: int) -> list:
    """Rank body (ps None: one process, plain forward): per BATCHES entry (logits, executor name or "", number of
    row-parallel sequence-parallel calls)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.communicator import create_communicator
    from sglang.srt.model_executor.executors.sequence_parallel import create_sequence_parallel_executor
    from sglang.srt.model_loader.loader import load_model

    config = ModelConfig.from_path(path)
    tp = dict(tp_rank=ps.tp_rank, tp_size=ps.tp_size, comm=create_communicator(ps, "auto")) if ps else {}
    model = load_model(config, "auto", "cpu", **tp)
    ex = None
    calls = [0]
    if ps is not None:
        ex = create_sequence_parallel_executor(model, ps, SimpleNamespace(
            chunked_prefill_size=64, max_running_requests=8, tdist_overlap_min_tokens=min_tokens))
        orig = ex.sp_ops.linear_rs
        ex.sp_ops.linear_rs = lambda *a, **kw: (calls.__setitem__(0, calls[0] + 1), orig(*a, **kw))[1]
    h = harness_for(model, config, ps.tp_size if ps else 1)
    out = []
    for items in BATCHES:
        before = calls[0]
        logits = h.run(h.prepare(items), ex).float().clone()
        out.append((logits, ex.last_executor if ex else "", calls[0] - before))
    return out


def test_selection_switches_at_the_threshold_and_outputs_stay_equal():
    path = shared_path("models", "stories260K")
    want = selected_logits(None, path, MIN_TOKENS)
    n_layers = len(_stories_model().decoder_layers)
    for rank, got in enumerate(spawn_ranks(selected_logits, 2, path, MIN_TOKENS, timeout=300)):
        for i, ((g, name, calls), (w, _, _), items) in enumerate(zip(got, want, BATCHES)):
            t = sum(len(toks) for _, toks in items)
            sp = t >= MIN_TOKENS
            assert name == ("sequence_parallel" if sp else "sequential"), f"rank {rank} batch {i} (T={t}): {name}"
            assert calls == (2 * n_layers if sp else 0), f"rank {rank} batch {i}: {calls} row-parallel SP calls"
            assert g.argmax(-1).tolist() == w.argmax(-1).tolist(), f"rank {rank} batch {i}: greedy tokens differ"
            torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL, msg=lambda m: f"rank {rank} batch {i}: {m}")


def test_min_tokens_zero_is_always_the_layout_and_negative_is_refused():
    from sglang.srt.distributed.sequence_parallel import TorchSequenceParallelOps
    from sglang.srt.model_executor.executors.sequence_parallel import SequenceParallelExecutor
    from sglang.srt.server_args import ServerArgs

    ex = SequenceParallelExecutor(TorchSequenceParallelOps(None, 0, 1))
    assert ex.select(1) is ex and SequenceParallelExecutor(ex.sp_ops, 5).select(4).name == "sequential"
    with pytest.raises(ValueError, match="min_tokens"):
        SequenceParallelExecutor(ex.sp_ops, -1)
    with pytest.raises(ValueError, match="tdist-overlap-min-tokens"):
        ServerArgs(model_path="m", tdist_overlap_min_tokens=-1)
