"""TokenWeave flags on every CLI, and which TP communicator a TokenWeave rank gets on gloo TP 2 (CPU):
``--enable-tokenweave`` makes tw-comm's communicator the default for split halves (``--comm-backend auto``: composed
with the plain server's communicator for unsplit calls; ``tw``: tw-comm for every call) in the server AND in
``bench_one_batch``; an explicit ``--comm-backend torch`` wins; when tw-comm cannot be built the
rank falls back to NCCL/gloo and says so; ``--tokenweave-comm-sms`` reaches the communicator (its SM budget
for overlapped calls)."""

from __future__ import annotations

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from tp_worker import spawn_ranks  # noqa: E402


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _rank_select(ps) -> dict:
    import sglang.bench_one_batch as bob
    import sglang.srt.distributed.tw_communicator as twc
    from sglang.srt.deployment.communicator import build_communicator
    from sglang.srt.server_args import ServerArgs

    log = logging.getLogger("sglang")
    log.setLevel(logging.INFO)
    handler = _Collect()
    log.addHandler(handler)
    on = ServerArgs(model_path="unused", device="cpu", tp_size=2, enable_tokenweave=True, tokenweave_comm_sms=24)
    off = on.replace(enable_tokenweave=False)

    def kind(comm):
        return type(comm).__name__

    out = {"on_auto": kind(build_communicator(ps, on)),
           "on_tw": kind(build_communicator(ps, on.replace(comm_backend="tw"))),
           "on_torch": kind(build_communicator(ps, on.replace(comm_backend="torch"))),
           "off_auto": kind(build_communicator(ps, off)),
           "bench_on": kind(bob.bench_communicator(ps, on, bob.BenchArgs())),
           "bench_off": kind(bob.bench_communicator(ps, off, bob.BenchArgs())),
           "sms": build_communicator(ps, on).comm_sms,
           "on_auto_plain": kind(build_communicator(ps, on).plain)}
    out["ok_log"] = "\n".join(handler.lines)
    handler.lines.clear()
    real_init = twc.TwCommunicator.__init__

    def unavailable(self, *a, **k):
        raise ImportError("tw-comm ops not built (test)")

    twc.TwCommunicator.__init__ = unavailable
    try:
        out["on_fallback"] = kind(build_communicator(ps, on))
        out["bench_fallback"] = kind(bob.bench_communicator(ps, on, bob.BenchArgs()))
    finally:
        twc.TwCommunicator.__init__ = real_init
    out["fallback_log"] = "\n".join(handler.lines)
    log.removeHandler(handler)
    return out


def test_tokenweave_communicator_choice_tp2():
    for rank, got in enumerate(spawn_ranks(_rank_select, 2, timeout=120)):
        # auto: unsplit calls on the plain server's communicator, split halves on tw-comm's; tw: tw-comm only
        assert (got["on_auto"], got["bench_on"], got["on_tw"]) == ("TokenWeaveCommunicator",) * 2 + ("TwCommunicator",)
        assert got["on_auto_plain"] == got["off_auto"] == "TorchCommunicator", (rank, got)
        assert got["sms"] == 24
        assert (got["on_torch"], got["off_auto"], got["bench_off"]) == ("TorchCommunicator",) * 3, (rank, got)
        assert (got["on_fallback"], got["bench_fallback"]) == ("TorchCommunicator",) * 2, (rank, got)
        assert "[TokenWeave]" in got["ok_log"] and "TwCommunicator(world_size=2" in got["ok_log"], got["ok_log"]
        assert "TokenWeaveCommunicator(unsplit forwards: TorchCommunicator(backend=gloo" in got["ok_log"], got["ok_log"]
        assert got["fallback_log"].count("tw-comm is unavailable (tw-comm ops not built (test)); falling back") == 2, \
            got["fallback_log"]


def test_tokenweave_flags_on_every_cli():
    """``--enable-tokenweave``, ``--tokenweave-min-tokens``, ``--tokenweave-comm-sms`` and ``--comm-backend`` parse
    the same on launch_server, bench_offline_throughput and bench_one_batch (sgl.Engine takes the same ServerArgs
    fields as keywords); bad values fail with a ValueError naming the flag and the fix."""
    import pytest

    import sglang.bench_offline_throughput as bot
    import sglang.bench_one_batch as bob
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    flags = ["--model-path", "m", "--enable-tokenweave", "--tokenweave-min-tokens", "512", "--tokenweave-comm-sms",
             "16", "--comm-backend", "tw"]
    parsed = [prepare_server_args(flags), ServerArgs.from_cli_args(bot.build_parser().parse_args(flags)),
              bob.parse_args(flags)[0], ServerArgs(model_path="m", enable_tokenweave=True, tokenweave_min_tokens=512,
                                                   tokenweave_comm_sms=16, comm_backend="tw")]
    for sa in parsed:
        assert (sa.enable_tokenweave, sa.tokenweave_min_tokens, sa.tokenweave_comm_sms, sa.comm_backend) == \
            (True, 512, 16, "tw")
    assert prepare_server_args(["--model-path", "m"]).tokenweave_min_tokens is None  # auto per TP size
    from sglang.srt.tokenweave import TOKENWEAVE_OFF, resolve_min_tokens

    assert [resolve_min_tokens(None, tp) for tp in (2, 4, 8)] == [TOKENWEAVE_OFF, 8192, 1024]
    assert resolve_min_tokens(None, 4, "NVIDIA H100 80GB HBM3") == 8192
    assert resolve_min_tokens(None, 2, "NVIDIA H200") == TOKENWEAVE_OFF  # measured H200 row: loses at every T
    assert resolve_min_tokens(None, 4, "NVIDIA H200") == 8192
    assert resolve_min_tokens(None, 2, "NVIDIA B200") == TOKENWEAVE_OFF  # unknown GPU: the H100 row
    assert resolve_min_tokens(512, 4) == 512
    with pytest.raises(ValueError, match="tokenweave-min-tokens=1 is invalid: use >= 2"):
        prepare_server_args(["--model-path", "m", "--tokenweave-min-tokens", "1"])
    with pytest.raises(ValueError, match="tokenweave-comm-sms=0 is invalid"):
        bob.parse_args(["--model-path", "m", "--tokenweave-comm-sms", "0"])
