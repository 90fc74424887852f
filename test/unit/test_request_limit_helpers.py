"""Unit tests of the request-limit helpers, the external-$ref check, stale IPC folder removal and the
rendezvous store's listening address."""

from __future__ import annotations

import json
import os
import random
import socket
import time
from datetime import timedelta

import psutil
import pytest

from sglang.srt.constrained.schema_refs import check_schema_refs, first_external_ref
from sglang.srt.entrypoints.request_limits import (
    check_json_value,
    check_n,
    check_token_ids,
    openai_field_names,
    parse_json_body,
)


def test_parse_json_body_depth_limit_any_depth():
    for depth in (101, 1000, 200_000):
        with pytest.raises(ValueError, match="nested deeper than 100 levels"):
            parse_json_body(("[" * depth + "]" * depth).encode())
    ok = "[" * 100 + "]" * 100
    assert parse_json_body(ok.encode()) is not None
    with pytest.raises(ValueError, match=r"^a\.b\[0\]: JSON nested deeper than 3"):
        check_json_value({"a": {"b": [[[1]]]}}, max_depth=3)


def test_lone_surrogates_are_named_by_path():
    rng = random.Random(0)
    for _ in range(20):  # valid non-ASCII text passes
        s = "".join(chr(rng.choice([rng.randrange(0x20, 0xD7FF), rng.randrange(0xE000, 0x10FFFF)])) for _ in range(30))
        check_json_value({"text": s, "stop": [s]})
    cases = {'{"text": "\\ud800"}': "text", '{"rid": ["ok", "\\udc81"]}': "rid[1]",
             '{"messages": [{"role": "user", "content": "a\\udfffb"}]}': "messages[0].content",
             '{"sampling_params": {"stop": ["x", "\\ud83d"]}}': "sampling_params.stop[1]"}
    for body, where in cases.items():
        with pytest.raises(ValueError) as ei:
            parse_json_body(body.encode())
        assert str(ei.value).startswith(f"{where}: the string contains a lone UTF-16 surrogate")
    assert parse_json_body('{"t": "\\ud83d\\ude00"}'.encode()) == {"t": "\U0001F600"}  # a valid pair
    with pytest.raises(ValueError, match="object key"):
        parse_json_body(b'{"\\ud800": 1}')
    with pytest.raises(ValueError, match="malformed JSON"):
        parse_json_body(b'{"a": ')


def test_check_n_and_token_ids():
    check_n(128, 128)
    check_n(None, 128)
    for bad in (129, 1e30, 10**40):
        with pytest.raises(ValueError, match=r"^n must be <= 128 \(the server's --max-n\)"):
            check_n(bad, 128)
    check_token_ids([0, 511], 512, "prompt")
    check_token_ids([[1], [2, 3]], 512, "prompt")
    for ids, msg in (([-1], "prompt: "), ([512], "prompt: "), ([[1], [2**70]], r"prompt\[1\]: ")):
        with pytest.raises(ValueError, match="^" + msg + r"token ids must lie in \[0, 512\)"):
            check_token_ids(ids, 512, "prompt")


def test_openai_field_names():
    msg = "plus max_new_tokens=5 ...; min_new_tokens must be <= max_new_tokens"
    assert openai_field_names(msg) == "plus max_tokens=5 ...; min_tokens must be <= max_tokens"
    assert openai_field_names("my_max_new_tokens_x") == "my_max_new_tokens_x"


def test_external_refs():
    assert first_external_ref({"$defs": {"a": {}}, "properties": {"x": {"$ref": "#/$defs/a"}}}) is None
    for ref in ("http://h/s.json", "file:///etc/passwd", "other.json#/a", "https://h/x#/y"):
        schema = {"anyOf": [{"type": "null"}, {"items": [{"$ref": ref}]}]}
        assert first_external_ref(schema) == ref
        with pytest.raises(ValueError, match="external \\$ref"):
            check_schema_refs(schema)
    deep: dict = {"$ref": "http://x"}
    for _ in range(5000):
        deep = {"properties": {"a": deep}}
    assert first_external_ref(deep) == "http://x"


def test_grammar_validator_rejects_external_ref():
    pytest.importorskip("xgrammar")
    from sglang.srt.constrained.xgrammar_backend import validate_grammar_spec

    with pytest.raises(ValueError, match="external \\$ref 'http://example.com/a.json'"):
        validate_grammar_spec("json_schema", json.dumps({"properties": {"a": {"$ref": "http://example.com/a.json"}}}))
    validate_grammar_spec("json_schema", json.dumps({"$defs": {"a": {"type": "string"}},
                                                     "properties": {"a": {"$ref": "#/$defs/a"}}}))


# ------------------------------------------------------------------ IPC folders
def test_stale_ipc_dirs_are_removed_live_ones_kept(tmp_path):
    import zmq

    from sglang.srt.utils.ipc_dirs import OWNER_FILE, remove_stale_ipc_dirs

    dead = subprocess_pid_that_exited()
    stale_pid = tmp_path / "sglang-ipc-dead"
    stale_pid.mkdir()
    (stale_pid / OWNER_FILE).write_text(str(dead))
    (stale_pid / "tokenizer").write_text("")
    stale_nopid = tmp_path / "sglang-ipc-old"
    stale_nopid.mkdir()
    (stale_nopid / "scheduler").write_text("")  # a leftover socket path nobody listens on
    live_pid = tmp_path / "sglang-ipc-live"
    live_pid.mkdir()
    (live_pid / OWNER_FILE).write_text(str(os.getpid()))
    live_sock = tmp_path / "sglang-ipc-sock"
    live_sock.mkdir()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{live_sock / 'tokenizer'}")
    young = tmp_path / "sglang-ipc-young"
    young.mkdir()
    try:
        for d in (stale_pid, stale_nopid, live_pid, live_sock):
            os.utime(d, (time.time() - 3600, time.time() - 3600))
        removed = remove_stale_ipc_dirs(str(tmp_path))
        assert sorted(removed) == sorted([str(stale_pid), str(stale_nopid)])
        assert live_pid.exists() and live_sock.exists() and young.exists()
    finally:
        pull.close(0)
        ctx.term()


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_port_args_record_owner_pid():
    from sglang.srt.server_args import PortArgs
    from sglang.srt.utils.ipc_dirs import OWNER_FILE

    pa = PortArgs.init_new()
    try:
        with open(os.path.join(pa.ipc_dir, OWNER_FILE)) as f:
            assert int(f.read()) == os.getpid()
    finally:
        import shutil

        shutil.rmtree(pa.ipc_dir, ignore_errors=True)


# ------------------------------------------------------------------ rendezvous
def test_rendezvous_store_listens_on_the_given_interface_only():
    from sglang.srt.distributed.rendezvous import create_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = create_store(f"tcp://127.0.0.1:{port}", 0, 1, timedelta(seconds=10))
    store.set("k", "v")
    assert store.get("k") == b"v"
    mine = [c.laddr for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert [a.ip for a in mine] == ["127.0.0.1"], mine
    with pytest.raises(RuntimeError, match="cannot listen on the rendezvous address"):
        create_store(f"tcp://127.0.0.1:{port}", 0, 1, timedelta(seconds=2))  # taken
    del store
