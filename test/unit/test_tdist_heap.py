"""Host-side bookkeeping of the Triton-distributed symmetric heap and argument validation of its ops (CPU, no
kernel launches): region/signal layout is deterministic and symmetric, epochs/cumulative targets, row splits,
config and bad-input errors name the value and the fix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sgl-kernel" / "python"))

from sgl_kernel.tdist.heap import SymmetricHeap, simulate_group  # noqa: E402
from sgl_kernel.tdist.layout import (ALIGN, HeapConfig, HeapLayout, SignalEpochs, align_up, offsets,  # noqa: E402
                                     split_rows)

CFG = HeapConfig(data_bytes=1 << 16, signal_slots=64)


def test_config_validation_and_sizes():
    with pytest.raises(ValueError, match="data_bytes"):
        HeapConfig(data_bytes=0)
    with pytest.raises(ValueError, match="signal_slots"):
        HeapConfig(signal_slots=-1)
    c = HeapConfig(data_bytes=1000, signal_slots=3)
    assert c.signal_bytes == ALIGN and c.total_bytes == ALIGN + align_up(1000)


def test_layout_regions_aligned_reused_and_grown():
    lay = HeapLayout(CFG)
    a = lay.region("a", 10)
    b = lay.region("b", 300)
    assert a == CFG.signal_bytes and b == a + ALIGN and b % ALIGN == 0
    assert lay.region("a", 200) == a  # fits: same offset
    a2 = lay.region("a", 4000)  # grows: a new region past b
    assert a2 > b and a2 % ALIGN == 0
    with pytest.raises(ValueError, match="raise HeapConfig.data_bytes"):
        lay.region("huge", 1 << 20)
    with pytest.raises(ValueError, match="nbytes"):
        lay.region("neg", -1)


def test_layout_signals():
    lay = HeapLayout(CFG)
    assert lay.signals("x", 8) == 0 and lay.signals("y", 4) == 8 and lay.signals("x", 8) == 0
    with pytest.raises(ValueError, match="new name"):
        lay.signals("y", 5)
    with pytest.raises(ValueError, match="signal region full"):
        lay.signals("z", 100)


def test_layout_is_symmetric_across_ranks():
    def build():
        lay = HeapLayout(CFG)
        lay.signals("s", 4)
        lay.region("g", 1234)
        lay.region("p", 99)
        return lay.fingerprint()

    assert build() == build()
    other = HeapLayout(CFG)
    other.region("p", 99)
    assert other.fingerprint() != build()


def test_epochs_and_cumulative_targets():
    e = SignalEpochs()
    assert [e.next("a") for _ in range(3)] == [1, 2, 3] and e.current("a") == 3 and e.current("b") == 0
    assert e.advance("t", 4) == 4 and e.advance("t", 0) == 4 and e.advance("t", 6) == 10
    with pytest.raises(ValueError):
        e.advance("t", -1)
    for i in range(10_000):  # reuse without reset: targets only grow
        assert e.next("reuse") == i + 1


@pytest.mark.parametrize("total,world", [(0, 2), (7, 3), (16, 4), (5, 8), (1, 1)])
def test_split_rows(total, world):
    rows = split_rows(total, world)
    assert sum(rows) == total and len(rows) == world and max(rows) - min(rows) <= 1
    assert list(rows) == sorted(rows, reverse=True)
    assert offsets(rows)[-1] == total and offsets(rows)[0] == 0


def test_split_rows_and_offsets_errors():
    with pytest.raises(ValueError):
        split_rows(3, 0)
    with pytest.raises(ValueError):
        offsets([1, -1])


def test_simulated_heaps_are_symmetric_views():
    hs = simulate_group(3, CFG)
    assert [h.rank for h in hs] == [0, 1, 2] and all(h.world == 3 for h in hs)
    assert all(b % 512 == 0 for b in hs[0].bases)
    assert all(h.meta.tolist() == [h.rank, 3, *hs[0].bases, CFG.wait_timeout_ns] for h in hs)
    assert all(h.layout.signals("tdist.error", 8) == 0 for h in hs)  # the error record is slots 0..7
    ts = [h.tensor("g", (4, 5), torch.float32) for h in hs]
    offs = [t.data_ptr() - h.bases[h.rank] for t, h in zip(ts, hs)]
    assert len(set(offs)) == 1 and offs[0] >= CFG.signal_bytes
    sig = [h.signals("s", 3) for h in hs]
    assert all(s.dtype == torch.int64 and s.abs().sum() == 0 for s in sig)
    ts[1].fill_(3.0)
    assert ts[0].abs().sum() == 0  # separate memory per rank
    hs[0].barrier()
    hs[0].close()


def test_heap_constructor_validation():
    buf = torch.zeros(CFG.total_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="rank"):
        SymmetricHeap(2, 2, buf, [0, 0], CFG, barrier=lambda: None)
    with pytest.raises(ValueError, match="base addresses"):
        SymmetricHeap(0, 2, buf, [0], CFG, barrier=lambda: None)
    with pytest.raises(ValueError, match="uint8"):
        SymmetricHeap(0, 1, buf[:10], [0], CFG, barrier=lambda: None)
    with pytest.raises(ValueError, match="CUDA device"):
        SymmetricHeap.create(None, torch.device("cpu"), CFG)
    with pytest.raises(ValueError, match="256-byte aligned"):  # symm_at's alignment hint relies on it
        SymmetricHeap(0, 2, buf, [0, 4096 + 16], CFG, barrier=lambda: None)


def test_device_counters_are_per_name_and_shared():
    h = simulate_group(1, CFG)[0]
    c = h.counters("op.a")
    assert c.dtype == torch.int64 and tuple(c.shape) == (2,) and int(c.abs().sum()) == 0
    c += 3
    assert h.counters("op.a") is c and int(h.counters("op.b").sum()) == 0


def test_op_argument_validation():
    pytest.importorskip("triton")
    from sgl_kernel.tdist.ag_gemm import AgGemm
    from sgl_kernel.tdist.all_to_all import AllToAll
    from sgl_kernel.tdist.gemm_rs import GemmRs

    h = simulate_group(2, HeapConfig(data_bytes=1 << 20, signal_slots=64))[0]
    ag = AgGemm(h, 32, 16, torch.float32)
    b = torch.randn(16, 8)
    with pytest.raises(ValueError, match="producer"):
        AgGemm(h, 32, 16, torch.float32, producer="nvls")
    with pytest.raises(ValueError, match=r"rows\[0\]=4"):
        ag.prepare(torch.randn(3, 16), b, [4, 4])
    with pytest.raises(ValueError, match="world=2"):
        ag.prepare(torch.randn(3, 16), b, [3])
    with pytest.raises(ValueError, match="max_rows=32"):
        ag.prepare(torch.randn(3, 16), b, [3, 30])
    with pytest.raises(ValueError, match="dtype"):
        ag.prepare(torch.randn(3, 16, dtype=torch.float64), b, [3, 3])
    with pytest.raises(ValueError, match="K=16"):
        ag.prepare(torch.randn(3, 15), torch.randn(15, 8), [3, 3])
    with pytest.raises(ValueError, match="contiguous"):
        ag.prepare(torch.randn(16, 3).t(), b, [3, 3])
    with pytest.raises(ValueError, match="heap too small"):
        AgGemm(h, 1 << 20, 1024, torch.float32, name="big")
    rs = GemmRs(h, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="sum"):
        rs.prepare(torch.randn(5, 16), b, [3, 3])
    with pytest.raises(ValueError, match="max_rows=8"):
        rs.prepare(torch.randn(18, 16), b, [9, 9])
    with pytest.raises(ValueError, match="N=8"):
        rs.prepare(torch.randn(6, 16), torch.randn(16, 9), [3, 3])
    a2a = AllToAll(h, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        a2a.prepare(torch.randn(4, 8), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="world=2"):
        a2a.prepare(torch.randn(4, 8), torch.tensor([2, 1, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="H=8"):
        a2a.prepare(torch.randn(4, 7), torch.tensor([2, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="capacity"):
        AllToAll(h, 0, 8)


def test_wait_error_record_decodes_kernel_rank_signal():
    from sgl_kernel.tdist.heap import TdistWaitError
    from sgl_kernel.tdist.layout import ERR_CMP, ERR_EXPECT, ERR_NS, ERR_REASON, ERR_SEEN, ERR_SIG, ERR_SITE

    hs = simulate_group(2, CFG)
    arrive = [h.signals("gemm_rs.arrive", 2) for h in hs]
    hs[1].check()  # clean record: no error
    idx = hs[1].layout.signals("gemm_rs.arrive", 2)
    rec = hs[1].error
    rec[0] = 2  # abort word: rank 1 timed out first
    rec[ERR_SITE], rec[ERR_SIG], rec[ERR_EXPECT], rec[ERR_SEEN] = 6, (idx + 0) * 8, 12, 8
    rec[ERR_REASON], rec[ERR_CMP], rec[ERR_NS] = 1, 3, 30_000_000_000
    with pytest.raises(TdistWaitError) as e:
        hs[1].check()
    msg = str(e.value)
    for part in ("rank 1 of 2", "rs_reduce_kernel", "gemm_rs.arrive[0]", ">= 12", "last value 8", "timed out",
                 "after 30.000 s", "HeapConfig.wait_timeout_s"):
        assert part in msg, (part, msg)
    hs[0].error[0] = 2  # the peer only saw the abort word
    with pytest.raises(TdistWaitError, match="aborted by rank 1"):
        hs[0].barrier()
    assert arrive[0].abs().sum() == 0
    assert "not a heap signal" in hs[0].signal_name(-4096)


def test_compare_accepts_a_rank_without_rows():
    """Regression of the 2026-11-25 GPU group stall: the old helper took ``ref.abs().max()`` of the empty reference
    of the rank that owns no rows, which raises, so only that rank left case_gemm_rs and its peers waited for it."""
    from sgl_kernel.tdist.reference import compare, gemm_rs_ref

    with pytest.raises(RuntimeError):
        torch.empty(0, 448).abs().max()  # what the old helper did
    a = [torch.randn(129, 32) for _ in range(2)]
    b = [torch.randn(48, 32).t() for _ in range(2)]
    ref = gemm_rs_ref(a, b, [0, 129])
    assert ref[0].shape == (0, 48) and compare(torch.empty(0, 48), ref[0], "rank 0") == []
    assert compare(ref[1].clone(), ref[1], "rank 1") == []
    bad = ref[1].clone()
    bad[3, 4] += 100.0
    assert "max error" in compare(bad, ref[1], "rank 1")[0]
    bad[0, 0] = float("nan")
    assert "non-finite" in compare(bad, ref[1], "rank 1")[0]
    assert "shape" in compare(torch.empty(1, 48), ref[0], "rank 0")[0]
