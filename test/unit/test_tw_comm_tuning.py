"""The calibrated crossover table of tw-comm (sglang.srt.distributed.tw_comm_tuning) and select_backend using it."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "python"), str(REPO / "sgl-kernel" / "python")]

from sglang.srt.distributed.tw_comm import TwBackend, TwCommConfig, select_backend  # noqa: E402
from sglang.srt.distributed.tw_comm_tuning import (  # noqa: E402
    DEFAULT_TABLE_PATH,
    UNBOUNDED,
    Crossovers,
    entries_from_timings,
    load_crossovers,
    write_table,
)

MIB = 1 << 20


def test_entries_pick_the_fastest_and_merge_equal_neighbours():
    t = {
        16 << 10: {("p2p_lamport", 64): 7.0, ("p2p_oneshot", 64): 9.0},
        1 * MIB: {("p2p_lamport", 64): 18.0, ("p2p_oneshot", 128): 16.0},
        2 * MIB: {("p2p_oneshot", 128): 20.0, ("p2p_twoshot_pipe", 128): 21.0},
        16 * MIB: {("p2p_twoshot_pipe", 128): 60.0, ("p2p_twoshot", 128): 90.0},
        64 * MIB: {("p2p_twoshot_pipe", 128): 200.0, ("p2p_twoshot", 128): 300.0},
    }
    e = entries_from_timings(t)
    assert [x[1:] for x in e] == [("p2p_lamport", 64), ("p2p_oneshot", 128), ("p2p_twoshot_pipe", 128)]
    assert e[0][0] == int((16 * 1024 * MIB) ** 0.5)  # geometric mean of the two sizes around the change
    assert e[1][0] == int((2 * MIB * 16 * MIB) ** 0.5) and e[-1][0] == UNBOUNDED
    c = Crossovers(plain=e)
    assert c.pick(1)[1] == "p2p_lamport" and c.pick(1 * MIB)[1] == "p2p_oneshot"
    assert c.pick(1 << 40)[1] == "p2p_twoshot_pipe" and Crossovers().pick(5) is None
    with pytest.raises(ValueError, match="no candidate"):
        entries_from_timings({5: {}})


def test_write_then_load_round_trip_and_bad_files(tmp_path, monkeypatch):
    path = tmp_path / "x.json"
    plain = ((MIB, "p2p_lamport", 64), (UNBOUNDED, "p2p_twoshot_pipe", 128))
    overlap = ((UNBOUNDED, "p2p_twoshot", 16),)
    write_table(path, "NVIDIA H200", 4, plain, overlap, "test")
    write_table(path, "NVIDIA H200", 2, plain[1:], overlap, "test")
    assert load_crossovers("NVIDIA H200", 4, path) == Crossovers(plain=plain, overlap=overlap)
    assert load_crossovers("NVIDIA H200", 2, path).plain == plain[1:]
    assert load_crossovers("NVIDIA H100 80GB HBM3", 4, path) == Crossovers()  # unknown GPU: no table
    assert load_crossovers("NVIDIA H200", 4, tmp_path / "missing.json") == Crossovers()
    monkeypatch.setenv("TW_COMM_CROSSOVERS", str(path))
    assert load_crossovers("NVIDIA H200", 4).overlap == overlap
    with pytest.raises(ValueError, match="backend"):
        write_table(path, "G", 2, ((5, "nccl", 8),), (), "bad")
    data = json.loads(path.read_text())
    data["tables"]["NVIDIA H200|4"]["plain"] = [[10, "p2p_oneshot", 8], [5, "p2p_oneshot", 8]]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="sorted"):
        load_crossovers("NVIDIA H200", 4, path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_crossovers("NVIDIA H200", 4, path)


def test_select_backend_follows_the_table_where_feasible():
    cap = 64 * MIB
    table = Crossovers(
        plain=((256 << 10, "p2p_lamport", 64), (2 * MIB, "p2p_oneshot", 128), (UNBOUNDED, "p2p_twoshot_pipe", 128)),
        overlap=((UNBOUNDED, "p2p_twoshot_pipe", 16),),
    )
    cfg = TwCommConfig(crossovers=table)
    sel = lambda T, **kw: select_backend(T, 8192, 4, config=cfg, capacity_bytes=cap, **kw)  # noqa: E731
    assert sel(8) == TwBackend.LAMPORT and sel(32) == TwBackend.ONESHOT and sel(128) == TwBackend.ONESHOT
    assert sel(129) == TwBackend.PIPE and sel(4096) == TwBackend.PIPE
    assert sel(8, overlap=True) == TwBackend.PIPE and sel(4096, overlap=True) == TwBackend.PIPE
    assert sel(8, elem=4) == TwBackend.ONESHOT  # no Lamport for 4-byte elements: the table's next feasible rule
    assert sel(8, fused=False) == TwBackend.ONESHOT  # plain AllReduce keeps the built-in rules
    assert sel(4097) == TwBackend.NCCL  # beyond capacity wins over the table
    # a one-shot pick that does not fit the staging region falls back to the built-in rules
    big = TwCommConfig(crossovers=Crossovers(plain=((UNBOUNDED, "p2p_oneshot", 64),)))
    assert select_backend(2048, 8192, 4, config=big, capacity_bytes=cap) == TwBackend.TWOSHOT
    # no table: the built-in rules as before
    assert select_backend(8, 8192, 4, config=TwCommConfig(), capacity_bytes=cap) == TwBackend.LAMPORT
    with pytest.raises(ValueError, match="pipe_chunk_bytes"):
        TwCommConfig(pipe_chunk_bytes=-1)


def test_packaged_table_parses_for_each_calibrated_gpu_and_world():
    """The shipped ``tw_comm_crossovers.json`` (written by ``benchmark/comm/bench_allreduce_rmsnorm.py --calibrate`` on the
    GPUs it names) validates for every (GPU, world) key it holds, with a plain and an overlap list each."""
    import json

    from sglang.srt.distributed import tw_comm_tuning as T

    data = json.loads(T.DEFAULT_TABLE_PATH.read_text())
    assert data["tables"], "the packaged table is empty"
    for key in data["tables"]:
        gpu, world = key.rsplit("|", 1)
        cross = T.load_crossovers(gpu, int(world), T.DEFAULT_TABLE_PATH)
        assert cross.plain and cross.overlap, key
        assert cross.plain[-1][0] == T.UNBOUNDED and cross.overlap[-1][0] == T.UNBOUNDED, key


def _packaged_pick(gpu: str, world: int, T: int, overlap: bool, bulk=None) -> TwBackend:
    """select_backend on the packaged table of (gpu, world) for a [T, 8192] bf16 call (TokenWeave's 70B shape)."""
    cfg = TwCommConfig(crossovers=load_crossovers(gpu, world, DEFAULT_TABLE_PATH), bulk_twoshot=bulk)
    cap = 2 * 8192 * 8192 * 2 * world
    return select_backend(T, 8192, world, config=cfg, overlap=overlap, capacity_bytes=cap)


@pytest.mark.parametrize("world", [2, 4])
def test_packaged_table_puts_tokenweave_overlap_on_bulk_twoshot_on_h200(world):
    """2026-11-27, 4 x H200: TokenWeave's overlapped calls (16 CTAs) of >= 1024 tokens run the bulk-copy
    two-shot; small overlapped calls keep one-shot / two-shot; ``bulk_twoshot=False`` restores the pre-bulk
    two-shot (the benchmark's old-comm baseline); the table's provenance names the measuring run."""
    for T in (1024, 2048, 4096, 8192):
        assert _packaged_pick("NVIDIA H200", world, T, True) == TwBackend.BULK
        assert _packaged_pick("NVIDIA H200", world, T, True, bulk=False) == TwBackend.TWOSHOT
    assert _packaged_pick("NVIDIA H200", world, 32, True) == TwBackend.ONESHOT
    assert _packaged_pick("NVIDIA H200", world, 32, True, bulk=False) == TwBackend.ONESHOT
    source = json.loads(DEFAULT_TABLE_PATH.read_text())["tables"][f"NVIDIA H200|{world}"]["source"]
    assert "2026-11-27 03:34 UTC" in source and "four_gpu.sh tw_comm_cta_sweep" in source


def test_packaged_table_plain_bulk_only_where_measured_faster():
    """Plain (non-overlapped, 128-CTA) calls: bulk only at world 4 from ~45 MiB (T=8192 at hidden 8192: 944.5 vs
    two-shot 981.4 us); world 4 T=1024 stays on the pipelined two-shot, world 2 on one-shot / pipelined two-shot."""
    assert _packaged_pick("NVIDIA H200", 4, 8192, False) == TwBackend.BULK
    assert _packaged_pick("NVIDIA H200", 4, 1024, False) == TwBackend.PIPE
    assert _packaged_pick("NVIDIA H200", 4, 8192, False, bulk=False) == TwBackend.TWOSHOT
    assert _packaged_pick("NVIDIA H200", 2, 1024, False) == TwBackend.ONESHOT
    assert _packaged_pick("NVIDIA H200", 2, 8192, False) == TwBackend.PIPE


@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"])
def test_unknown_gpu_keeps_built_in_two_shot(gpu):
    """A GPU model without a calibrated table keeps the built-in rules: no bulk kernel unless forced."""
    assert load_crossovers(gpu, 4, DEFAULT_TABLE_PATH) == Crossovers()
    assert _packaged_pick(gpu, 4, 4096, True) == TwBackend.TWOSHOT
    assert _packaged_pick(gpu, 4, 4096, False) == TwBackend.TWOSHOT
    assert _packaged_pick(gpu, 4, 4096, True, bulk=True) == TwBackend.BULK
