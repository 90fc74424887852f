"""Server-side pieces of PD disaggregation, without servers: the slot planner's byte copies equal direct tensor
indexing for any TP split / page size / slot lists (property test, executed with ctypes memmove between two
real KV pools), KV head ranges, the coalescing rule (merge only when both sides continue), room derivation
for n > 1, the bootstrap request fields' validation, the control messages' wire form and the flags."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.disaggregation.messages import RoomFailed, RoomReady, decode_control, encode_control
from sglang.srt.disaggregation.rooms import derive_room
from sglang.srt.disaggregation.slot_plan import (assign_sources, copies_by_layer, kv_head_range, plan_slot_copies,
                                                 readers_of)
from sglang.srt.disaggregation.transfer.kv_plan import coalesce_array
from sglang.srt.managers.generate_req import GenerateReqInput
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.server_args import ServerArgs

LAYERS, HEADS, HD = 3, 4, 8


LAYOUTS = ("layer_major", "token_major")


def _pool(tp: int, page: int, slots: int = 64, layout: str = "layer_major") -> MHATokenToKVPool:
    return MHATokenToKVPool(slots, page, torch.float32, HEADS // tp if tp <= HEADS else 1, HD, LAYERS, "cpu", layout)


def _execute(copies) -> None:
    """Run a plan's byte copies (host memory: ctypes memmove)."""
    for s_addr, d_addr, nbytes in copies.tolist():
        ctypes.memmove(d_addr, s_addr, nbytes)


def test_kv_head_range():
    assert [kv_head_range(r, 2, 4) for r in range(2)] == [(0, 2), (2, 4)]
    assert [kv_head_range(r, 8, 4) for r in range(8)] == [(r // 2, r // 2 + 1) for r in range(8)]
    with pytest.raises(ValueError):
        kv_head_range(2, 2, 4)
    with pytest.raises(ValueError):
        kv_head_range(0, 3, 4)


def test_assign_sources_reads_each_head_once():
    ranks = [{"rank": r, "head_lo": kv_head_range(r, 8, 4)[0], "head_hi": kv_head_range(r, 8, 4)[1]} for r in range(8)]
    got = assign_sources(ranks, (0, 4))  # replicated heads: rank 2h holds head h first
    assert [(i["rank"], h) for i, h in got] == [(0, (0, 1)), (2, (1, 2)), (4, (2, 3)), (6, (3, 4))]
    two = [{"rank": r, "head_lo": 2 * r, "head_hi": 2 * r + 2} for r in range(2)]
    assert [(i["rank"], h) for i, h in assign_sources(two, (1, 3))] == [(0, (1, 2)), (1, (2, 3))]
    with pytest.raises(ValueError, match="held by no"):
        assign_sources(two[:1], (0, 4))


@settings(max_examples=40, deadline=None)
@given(p_tp=st.sampled_from([1, 2, 4, 8]), d_tp=st.sampled_from([1, 2, 4, 8]), p_page=st.sampled_from([1, 4, 16]),
       d_page=st.sampled_from([1, 4, 16]), n=st.integers(1, 30), seed=st.integers(0, 1000), runs=st.booleans(),
       coalesce=st.booleans(), p_layout=st.sampled_from(LAYOUTS), d_layout=st.sampled_from(LAYOUTS))
def test_copies_equal_direct_indexing(p_tp, d_tp, p_page, d_page, n, seed, runs, coalesce, p_layout, d_layout):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(LAYERS, 2, n, HEADS, HD, generator=g)  # the prompt's KV of all heads
    src_pools = [_pool(p_tp, p_page, layout=p_layout) for _ in range(p_tp)]
    dst_pools = [_pool(d_tp, d_page, layout=d_layout) for _ in range(d_tp)]
    src_slots = (torch.randperm(60, generator=g)[:n] + p_page).tolist()  # any slots past the dummy page
    dst_slots = (torch.randperm(60, generator=g)[:n] + d_page).tolist()
    if runs:  # runs of consecutive slots on both sides (the usual case), broken at random points
        cut = int(torch.randint(0, n, (1,), generator=g))
        src_slots = list(range(p_page, p_page + cut)) + list(range(p_page + cut + 3, p_page + n + 3))
        dst_slots = list(range(d_page + 5, d_page + 5 + n))
    for r, pool in enumerate(src_pools):
        lo, hi = kv_head_range(r, p_tp, HEADS)
        pool.kv_layer_view[:, :, src_slots] = full[:, :, :, lo:hi]
    infos = [{"rank": r, "head_lo": kv_head_range(r, p_tp, HEADS)[0], "head_hi": kv_head_range(r, p_tp, HEADS)[1]}
             for r in range(p_tp)]
    for d, dpool in enumerate(dst_pools):
        dh = kv_head_range(d, d_tp, HEADS)
        for info, heads in assign_sources(infos, dh):
            spool = src_pools[info["rank"]]
            for s_addr, d_addr, nbytes in plan_slot_copies(spool.describe(), (info["head_lo"], info["head_hi"]),
                                                           src_slots, dpool.describe(), dh, dst_slots,
                                                           heads=heads, coalesce=coalesce).tolist():
                ctypes.memmove(d_addr, s_addr, nbytes)
        torch.testing.assert_close(dpool.kv_layer_view[:, :, dst_slots], full[:, :, :, dh[0]:dh[1]], rtol=0, atol=0)


def test_coalescing_needs_both_sides_contiguous():
    src, dst = _pool(1, 1), _pool(1, 1)
    both = plan_slot_copies(src.describe(), (0, 4), [5, 6, 7], dst.describe(), (0, 4), [9, 10, 11])
    assert len(both) == LAYERS * 2  # one range per (layer, K/V)
    only_src = plan_slot_copies(src.describe(), (0, 4), [5, 6, 7], dst.describe(), (0, 4), [9, 11, 12])
    assert len(only_src) == LAYERS * 2 * 2
    dst_half = _pool(2, 1)  # one pool for both plans below (a fresh pool may or may not reuse the freed memory)
    half = plan_slot_copies(src.describe(), (0, 4), [5, 6, 7], dst_half.describe(), (2, 4), [9, 10, 11])
    assert len(half) == LAYERS * 2 * 3  # a head sub-range of the source is strided: one range per token
    assert set(half[:, 2].tolist()) == {2 * HD * 4}
    # coalesce=False (the pull path) merges runs of tokens before building rows: the same copies, as few rows
    runs = plan_slot_copies(src.describe(), (0, 4), [5, 6, 7], dst.describe(), (0, 4), [9, 10, 11], coalesce=False)
    assert runs.tolist() == both.tolist()
    gap = plan_slot_copies(src.describe(), (0, 4), [5, 6, 7], dst.describe(), (0, 4), [9, 11, 12], coalesce=False)
    assert gap.tolist() == only_src.tolist()
    per_tok = plan_slot_copies(src.describe(), (0, 4), [5, 6, 7], dst_half.describe(), (2, 4), [9, 10, 11],
                               coalesce=False)
    assert per_tok.tolist() == half.tolist()  # strided: still one row per token
    per_layer = copies_by_layer(both, src.describe())
    assert [len(x) for x in per_layer] == [2] * LAYERS
    assert plan_slot_copies(src.describe(), (0, 2), [5], dst.describe(), (2, 4), [9]).shape == (0, 3)
    with pytest.raises(ValueError):
        plan_slot_copies(src.describe(), (0, 4), [5, 6], dst.describe(), (0, 4), [9])
    with pytest.raises(ValueError):
        plan_slot_copies(src.describe(), (0, 4), [10_000], dst.describe(), (0, 4), [9])


def _filled(tp: int, layout: str, seed: int) -> MHATokenToKVPool:
    pool = _pool(tp, 1, layout=layout)
    pool.kv_data.copy_(torch.randn(pool.kv_data.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def test_token_major_run_is_one_copy_across_layers():
    """Token-major on both sides with the same heads: a run of consecutive slots on both sides is ONE
    copy covering every layer and K/V (layer-major: one per (layer, K/V)); the bytes equal the reference gather."""
    src, dst = _filled(1, "token_major", 1), _pool(1, 1, layout="token_major")
    ref = src.kv_layer_view[:, :, [5, 6, 7, 8]].clone()
    for coalesce in (False, True):
        copies = plan_slot_copies(src.describe(), (0, 4), [5, 6, 7, 8], dst.describe(), (0, 4), [9, 10, 11, 12],
                                  coalesce=coalesce)
        assert len(copies) == 1 and copies[0, 2] == 4 * LAYERS * 2 * HEADS * HD * 4
    _execute(copies)
    torch.testing.assert_close(dst.kv_layer_view[:, :, [9, 10, 11, 12]], ref, rtol=0, atol=0)
    gap = plan_slot_copies(src.describe(), (0, 4), [5, 6, 7, 8], dst.describe(), (0, 4), [20, 21, 30, 31])
    assert len(gap) == 2  # two runs on the destination: two copies
    # a layerwise push of all-layer rows posts them with the last layer (the only correct layer for them)
    assert [len(x) for x in copies_by_layer(gap, src.describe())] == [0] * (LAYERS - 1) + [2]
    assert [len(x) for x in copies_by_layer(gap, dst.describe(), side=1)] == [0] * (LAYERS - 1) + [2]


@pytest.mark.parametrize("p_layout,d_layout,p_tp,d_tp", [("token_major", "layer_major", 1, 1),
                                                         ("layer_major", "token_major", 1, 1),
                                                         ("token_major", "token_major", 1, 2),
                                                         ("token_major", "token_major", 2, 1),
                                                         ("token_major", "layer_major", 2, 4)])
def test_mixed_layouts_and_head_ranges_stay_byte_correct(p_layout, d_layout, p_tp, d_tp):
    """Different layouts or head ranges on the two sides: one copy per (layer, K/V, token) (nothing continues on
    both sides), each in one layer (copies_by_layer puts it there), and the bytes equal the reference gather."""
    src_slots, dst_slots = [3, 4, 5, 6, 7], [40, 41, 42, 43, 44]
    srcs = [_filled(p_tp, p_layout, 10 + r) for r in range(p_tp)]
    infos = [{"rank": r, "head_lo": kv_head_range(r, p_tp, HEADS)[0], "head_hi": kv_head_range(r, p_tp, HEADS)[1]}
             for r in range(p_tp)]
    full = torch.cat([p.kv_layer_view[:, :, src_slots] for p in srcs], dim=3)  # [L, 2, n, HEADS, HD]
    for d in range(d_tp):
        dst, dh = _pool(d_tp, 1, layout=d_layout), kv_head_range(d, d_tp, HEADS)
        for info, heads in assign_sources(infos, dh):
            copies = plan_slot_copies(srcs[info["rank"]].describe(), (info["head_lo"], info["head_hi"]), src_slots,
                                      dst.describe(), dh, dst_slots, heads=heads)
            assert len(copies) == LAYERS * 2 * len(src_slots)
            by_layer = copies_by_layer(copies, dst.describe(), side=1)
            assert [len(x) for x in by_layer] == [2 * len(src_slots)] * LAYERS
            for layer, rows in enumerate(by_layer):
                dst.kv_layer_view[layer].zero_()
                _execute(rows)  # only this layer's rows: exactly this layer's bytes arrive
                got = dst.kv_layer_view[layer][:, dst_slots][:, :, heads[0] - dh[0]:heads[1] - dh[0]]
                torch.testing.assert_close(got, full[layer][:, :, heads[0]:heads[1]], rtol=0, atol=0)


def _infos(tp: int) -> list[dict]:
    return [{"rank": r, "agent": f"a{r}", "head_lo": kv_head_range(r, tp, HEADS)[0],
             "head_hi": kv_head_range(r, tp, HEADS)[1]} for r in range(tp)]


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (2, 4), (4, 2), (2, 8), (8, 2), (8, 8)])
def test_readers_of_matches_assign_sources(p_tp, d_tp):
    """Whose COMPLETE each prefill rank waits for: exactly the decode ranks that read from it (heads replicated
    on TP > KV heads are read from their first holder only, so the other holders wait for nobody)."""
    src, dst = _infos(p_tp), _infos(d_tp)
    readers = {p: [d["agent"] for d in readers_of(p, src, dst)] for p in range(p_tp)}
    reads = {p: [] for p in range(p_tp)}
    for d in dst:
        for info, _ in assign_sources(src, (d["head_lo"], d["head_hi"])):
            reads[info["rank"]].append(d["agent"])
    assert readers == reads
    assert sorted(a for v in readers.values() for a in v) == sorted(  # every decode rank completes >= once
        a for d in dst for a in [d["agent"]] * len(assign_sources(src, (d["head_lo"], d["head_hi"]))))
    if (p_tp, d_tp) == (2, 4):  # decode ranks 0, 1 hold heads 0, 1 (prefill rank 0); 2, 3 hold 2, 3 (rank 1)
        assert readers == {0: ["a0", "a1"], 1: ["a2", "a3"]}
    if (p_tp, d_tp) == (8, 2):  # prefill ranks 2h and 2h+1 both hold head h: only 2h is read
        assert readers == {0: ["a0"], 1: [], 2: ["a0"], 3: [], 4: ["a1"], 5: [], 6: ["a1"], 7: []}


def test_uncoalesced_plan_coalesces_to_the_plan():
    """The pull path hands per-(layer, K/V, token) ops to the TransferQueue, which coalesces them: the result
    is the coalesced plan, and the op count is layers x 2 x tokens."""
    src, dst = _pool(1, 1), _pool(2, 16)
    slots_s, slots_d = [5, 6, 7, 9, 10], [16, 17, 18, 19, 33]
    raw = plan_slot_copies(src.describe(), (0, 4), slots_s, dst.describe(), (0, 2), slots_d, coalesce=False)
    assert len(raw) == LAYERS * 2 * len(slots_s)
    merged = plan_slot_copies(src.describe(), (0, 4), slots_s, dst.describe(), (0, 2), slots_d)
    assert (coalesce_array(raw) == merged).all()
    full = plan_slot_copies(src.describe(), (0, 4), slots_s, _pool(1, 16).describe(), (0, 4), slots_d)
    assert len(full) == LAYERS * 2 * 3  # runs contiguous on both sides: [5-7 -> 16-18], [9 -> 19], [10 -> 33]


def test_derive_room_and_bootstrap_fields():
    assert derive_room(123, 0) == 123
    rooms = {derive_room(123, j) for j in range(100)}
    assert len(rooms) == 100 and all(0 <= r < 2 ** 63 for r in rooms)
    reqs = GenerateReqInput(text="hi", sampling_params={"n": 3}, bootstrap_host="h", bootstrap_port=8998,
                            bootstrap_room=7).normalize()
    assert [r.bootstrap_room for r in reqs] == [7, derive_room(7, 1), derive_room(7, 2)]
    assert {r.bootstrap_host for r in reqs} == {"h"}
    batch = GenerateReqInput(text=["a", "b"], bootstrap_room=[1, 2], bootstrap_host="h", bootstrap_port=1).normalize()
    assert [r.bootstrap_room for r in batch] == [1, 2]
    for bad in ({"bootstrap_room": -1}, {"bootstrap_room": "x"}, {"bootstrap_port": 0}):
        with pytest.raises(ValueError, match=list(bad)[0]):
            GenerateReqInput(text="hi", **bad).normalize()
    with pytest.raises(ValueError, match="bootstrap_room"):
        GenerateReqInput(text=["a", "b"], bootstrap_room=3).normalize()
    assert GenerateReqInput.from_dict({"text": "x", "bootstrap_host": "h"}).bootstrap_host == "h"


def test_control_messages_roundtrip():
    m = RoomReady(room=5, slots=[1, 2], first_token=9, output_logprob=(-0.5, 9), checksums=[1, 2, 3])
    assert decode_control(encode_control(m)) == m
    f = RoomFailed(room=5, reason="x", local=True)
    assert decode_control(encode_control(f)) == f


def test_flags_validated():
    assert ServerArgs().disaggregation_bootstrap_port == 8998
    for kw, flag in [({"disaggregation_mode": "x"}, "disaggregation-mode"),
                     ({"disaggregation_transfer_backend": "ucx"}, "disaggregation-transfer-backend"),
                     ({"disaggregation_transfer_mode": "both"}, "disaggregation-transfer-mode"),
                     ({"disaggregation_heartbeat_timeout": 0}, "disaggregation-heartbeat-timeout"),
                     ({"kv_cache_layout": "slot_major"}, "kv-cache-layout")]:
        with pytest.raises(ValueError, match=flag):
            ServerArgs(**kw)


@pytest.mark.parametrize("mode,transfer,flag,want", [
    ("null", "pull", "auto", "layer_major"), ("prefill", "pull", "auto", "token_major"),
    ("decode", "pull", "auto", "token_major"), ("prefill", "push", "auto", "layer_major"),
    ("decode", "push", "auto", "layer_major"), ("null", "pull", "token_major", "token_major"),
    ("decode", "pull", "layer_major", "layer_major")])
def test_kv_cache_layout_resolution(mode, transfer, flag, want):
    """--kv-cache-layout auto: token_major exactly for pull-mode PD servers (both sides alike); explicit wins."""
    args = ServerArgs(disaggregation_mode=mode, disaggregation_transfer_mode=transfer, kv_cache_layout=flag)
    assert args.resolved_kv_cache_layout == want
