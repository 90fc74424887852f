"""The PD connector's contract is a class: :class:`KVConnector` declares exactly the methods the scheduler calls on
``self.disagg``, the prefill and decode connectors implement it, and no connector touches the scheduler's private
state (it returns decisions the scheduler applies)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from sglang.srt.disaggregation.connector import BaseConnector, KVConnector
from sglang.srt.disaggregation.decode import DecodeConnector
from sglang.srt.disaggregation.prefill import PrefillConnector

SRT = Path(__file__).resolve().parents[2] / "python" / "sglang" / "srt"
SCHEDULER_STATE = {"_release", "outputs", "running", "waiting", "enqueue", "tree_cache", "stats_prompt_tokens",
                   "stats_cached_tokens", "stats_gen_tokens", "chunked_req", "grammar_queue"}


def _calls_on_disagg() -> set[str]:
    """Every ``self.disagg.<name>`` the scheduler's modules use."""
    names = set()
    for p in (SRT / "managers").glob("scheduler*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "disagg" and isinstance(node.value.value, ast.Name) \
                    and node.value.value.id == "self":
                names.add(node.attr)
    return names


def test_abc_declares_every_method_the_scheduler_calls():
    called = _calls_on_disagg()
    assert len(called) >= 9, called  # intercept, poll, before_forward, hold, abort, open_rids, has_work, ...
    assert called == set(KVConnector.__abstractmethods__), (called, KVConnector.__abstractmethods__)


def test_prefill_and_decode_connectors_are_complete():
    for cls in (PrefillConnector, DecodeConnector):
        assert issubclass(cls, KVConnector) and not inspect.isabstract(cls), cls


def test_connectors_do_not_touch_scheduler_state():
    """No attribute access of the scheduler's queues, release or counters in disaggregation/ (decisions instead),
    and the connectors keep no reference to the scheduler."""
    bad = {}
    for p in (SRT / "disaggregation").glob("*.py"):
        hits = sorted({node.attr for node in ast.walk(ast.parse(p.read_text()))
                       if isinstance(node, ast.Attribute) and node.attr in SCHEDULER_STATE})
        if hits:
            bad[p.name] = hits
    assert not bad, f"connectors touch scheduler state: {bad}"
    src = inspect.getsource(BaseConnector.__init__)
    assert "self.s =" not in src and "self.scheduler" not in src
