"""The MoE layout matrix through the real scheduler (CPU, gloo, one process per rank) on ``stories260K-moe8`` (8
different experts: a token sent to the wrong expert changes the logits): DP attention and TP attention, at EP 2 and 4,
with each ``--moe-a2a-backend`` and with and without forced two-batch overlap (``--tbo-min-tokens 2``), each rank's
``Scheduler`` + ``ModelRunner`` built from the deployment plan as a server worker builds them, give the TP1 greedy
tokens of the shared prompts over a schedule with chunked prefill and mixed prefill + decode batches, requests joining
mid-decode, retraction (a small KV pool), an abort in flight and, under DP attention, one request on the last rank
with every other rank idle (see ``ep_schedule_worker.py``).

Only the combinations no other test runs are here (the rest: ``test_ep_a2a.py``, ``test_two_batch_overlap_ep.py``,
``test_dp_attention_moe.py`` and the servers of ``test/integration/``; the table is in ``docs/expert_parallel.md``).
Every configuration of one world size runs in ONE process group (starting ranks is the slow part on CPU); tdist runs
its Triton kernels under the interpreter (its configurations are left out, naming why, when triton or sgl_kernel is
missing), at world 2 only, with 8 new tokens per request in a 48-token KV pool.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from conftest import shared_path  # noqa: E402
from ep_a2a_worker import tp1_greedy_tokens  # noqa: E402
from ep_schedule_worker import KV_TOKENS, N_NEW, schedule_world  # noqa: E402
from tp_worker import spawn_ranks  # noqa: E402

MODEL = shared_path("models", "stories260K-moe8")
PROMPTS = {"P0": "Once upon a time", "P1": "The little dog", "P2": "Lily and Tom went to the park. They",
           "P3": "One day, a bird", "LONG": "Lily and Tom went to the park. They saw a big red ball and a little dog. "
           "The dog"}
HAS_TRITON = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("sgl_kernel") is not None
TDIST_SHORT = 8  # new tokens per request of the tdist configurations (the Triton interpreter's cost)
TDIST_SHORT_KV = 48  # their KV pool, with --schedule-conservativeness 0.5: the requests of rank 1 retract


def _cfg(name: str, dp: bool, a2a: str, tbo: bool, overlap: bool = False, short: bool = False) -> dict:
    """``short``: TDIST_SHORT new tokens per request in a KV pool small enough to retract them (interpreter cost)."""
    return dict(name=name, dp=dp, a2a=a2a, tbo=tbo, overlap=overlap, n_new=TDIST_SHORT if short else N_NEW,
                kv_tokens=TDIST_SHORT_KV if short else KV_TOKENS, conservativeness=0.5 if short else 1.0)


# the combinations no other test covers (docs/expert_parallel.md has the whole table). Not here for cost: tdist at
# world 4 (about 80 s per configuration under the interpreter on 2 cores; its EP 4 dispatch is in test_ep_a2a.py)
CONFIGS = {
    2: [_cfg("dp-none-tbo", True, "none", True, overlap=True), _cfg("dp-nccl-tbo", True, "nccl", True),
        _cfg("dp-tdist", True, "tdist", False, short=True), _cfg("dp-tdist-tbo", True, "tdist", True, short=True)],
    4: [_cfg("dp-none", True, "none", False), _cfg("dp-none-tbo", True, "none", True),
        _cfg("dp-nccl", True, "nccl", False, overlap=True), _cfg("tp-nccl-tbo", False, "nccl", True)],
}


def _configs(world: int) -> list:
    return [c for c in CONFIGS[world] if c["a2a"] != "tdist" or HAS_TRITON]


@functools.lru_cache(maxsize=None)
def _prompt_ids() -> dict:
    from sglang.srt.utils.common import get_tokenizer

    tok = get_tokenizer(MODEL)
    return {k: tuple(tok.encode(v)) for k, v in PROMPTS.items()}


@functools.lru_cache(maxsize=None)
def _tp1(name: str) -> list:
    """TP1 greedy tokens of prompt ``name``, as many as the longest request of it asks for."""
    return tp1_greedy_tokens(MODEL, list(_prompt_ids()[name]), 2 * N_NEW if name == "P0" else N_NEW)


@functools.lru_cache(maxsize=None)
def _world(world: int) -> list:
    return spawn_ranks(schedule_world, world, MODEL, _prompt_ids(), _configs(world), ep_size=world, timeout=1200)


def _check_tokens(cfg: dict, res: dict, rank: int) -> None:
    """Every finished request equals TP1 (its prompt is the rid's prefix); the victim was aborted with a TP1 prefix."""
    for rid, r in res["results"].items():
        want = _tp1(rid.split("-")[0].split("@")[0] if not rid.startswith("victim") else "P0")
        if rid.startswith("victim"):
            assert r["finish"]["type"] == "abort", (cfg["name"], rank, rid, r["finish"])
            assert 0 < len(r["ids"]) < 2 * cfg["n_new"] and r["ids"] == want[:len(r["ids"])], (cfg["name"], rank, rid)
        else:
            assert r["ids"] == want[:cfg["n_new"]], (cfg["name"], rank, rid)
            assert r["finish"]["type"] == "length", (cfg["name"], rank, rid, r["finish"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_layouts_give_tp1_tokens_through_the_scheduler(world):
    if not os.path.isdir(MODEL):
        pytest.skip(f"{MODEL} is not present (shared test data)")
    configs = _configs(world)
    ranks = _world(world)
    expected_rids = {c["name"]: set() for c in configs}
    for rank, per_rank in enumerate(ranks):
        for cfg, res in zip(configs, per_rank):
            assert res["name"] == cfg["name"] and res["kv_returned"], (rank, res["name"])
            _check_tokens(cfg, res, rank)
            expected_rids[cfg["name"]] |= set(res["results"])
            a2a = res["a2a_calls"]
            if cfg["a2a"] == "none":
                assert a2a is None and res["scope"] is None
            else:  # the plan's token scope; both all-to-all modes ran (decode steps low-latency, the rest normal)
                assert res["scope"] == ("local" if cfg["dp"] else "tp_slice"), (cfg["name"], res["scope"])
                assert a2a["normal"] > 0 and a2a["low_latency"] > 0, (cfg["name"], rank, a2a)
            assert res["executor"] == ("two_batch_overlap" if cfg["tbo"] else "sequential")
    print(f"world {world}: " + ", ".join(f"{r['name']} {r['seconds']} s" for r in ranks[0]))  # --durations detail
    for cfg, *per_rank in zip(configs, *ranks):
        name, n = cfg["name"], len(per_rank)
        assert "victim-P0" in "".join(expected_rids[name]) and any("late" in r for r in expected_rids[name])
        modes = [m for res in per_rank for m, _, _ in res["launched"]]
        assert "MIXED" in modes, (name, "a request joined while others decoded")
        assert sum(res["retractions"] for res in per_rank) > 0, (name, "the small KV pool retracted")
        splits = [res["splits"] for res in per_rank]
        assert all(s > 0 for s in splits) if cfg["tbo"] else not any(splits), (name, splits)
        if cfg["dp"]:
            _check_dp_lockstep(cfg, per_rank, n)
    if len(configs) < len(CONFIGS[world]):
        pytest.skip("triton / sgl_kernel are not installed: the tdist configurations did not run (the others passed)")


def _check_dp_lockstep(cfg: dict, per_rank: list, n: int) -> None:
    """Every rank ran every forward with the same agreed step (its own token count in it, an idle batch exactly when
    it had none, the all-to-all mode low-latency only on decode/idle-only steps, splits only when every rank had a
    batch); in the solo phase only the last rank had tokens."""
    name = cfg["name"]
    launched = [res["launched"] for res in per_rank]
    assert len({len(x) for x in launched}) == 1, (name, [len(x) for x in launched])
    for i in range(len(launched[0])):
        steps = {x[i][2] for x in launched}
        assert len(steps) == 1, (name, i, steps)
        tokens, mode, split_all = steps.pop()
        kinds = [x[i][0] for x in launched]
        for r, x in enumerate(launched):
            assert x[i][1] == tokens[r] and (x[i][0] == "IDLE") == (tokens[r] == 0), (name, i, r, x[i])
        low_latency = cfg["a2a"] != "none" and all(k in ("DECODE", "IDLE") for k in kinds)
        assert mode == ("low_latency" if low_latency else "normal"), (name, i, kinds, mode)
        assert not split_all or "IDLE" not in kinds, (name, i)
    solo = [res["steps"]["solo"] for res in per_rank]
    assert len(set(solo)) == 1, (name, solo)
    idle = [res["idle"]["solo"] for res in per_rank]
    assert idle[-1] == 0 and len(set(idle[:-1])) == 1 and idle[0] >= cfg["n_new"] - 1, (name, idle)  # n-1 idle
    assert per_rank[-1]["results"][f"P2-solo@{n - 1}"]["ids"]
