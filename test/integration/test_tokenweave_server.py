"""``--enable-tokenweave`` through the HTTP server on gloo TP ranks: greedy tokens equal TP=1's on stories260K
and its MoE twin, for long single prompts and batches whose prefill straddles the split (min tokens 8, so
every prefill and mixed step is split), with chunked prefill and a cached prefix, at TP 2 and 4 on both models with
the default sharded residual, and at TP 2 with ``--tokenweave-full-residual``.
The server's log shows tw-comm's communicator chosen by default for the split halves, the plain (gloo) communicator
for unsplit forwards, and each batch size's split decision logged once per rank (decode batches:
unsplit)."""

from __future__ import annotations

import collections
import os
import re
import sys

import pytest
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))
from conftest import shared_path  # noqa: E402
from server_utils import ServerProcess  # noqa: E402
from test_tp_cpu import N_NEW, generate, tokenize, tp1_greedy  # noqa: E402

PROMPTS = ["Once upon a time, there was a little girl named Lily who loved to play outside in the sun",
           "The little dog", "Lily and Tom went to the park. They", "One day, a bird"]


@pytest.mark.parametrize("name,tp,full", [("stories260K", 2, False), ("stories260K-moe", 2, False),
                                          ("stories260K", 4, False), ("stories260K-moe", 4, False),
                                          ("stories260K", 2, True)])
def test_tokenweave_greedy_equals_tp1(name, tp, full):
    """The default (split forwards keep the residual sharded), and ``full``: with ``--tokenweave-full-residual``."""
    path = shared_path("models", name)
    flags = ["--tokenweave-full-residual"] if full else []
    with ServerProcess(["--model-path", path, "--device", "cpu", "--tp", str(tp), "--enable-tokenweave",
                        "--tokenweave-min-tokens", "8", "--chunked-prefill-size", "32", *flags]) as s:
        sp = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}
        single = generate(s, {"text": PROMPTS[0], "sampling_params": sp})
        assert single["output_ids"] == tp1_greedy(path, tokenize(path, PROMPTS[0]))
        batch = generate(s, {"text": PROMPTS, "sampling_params": sp})  # prefix of PROMPTS[0] is now cached
        for p, o in zip(PROMPTS, batch):
            assert o["output_ids"] == tp1_greedy(path, tokenize(path, p)), p
        assert batch[0]["meta_info"]["cached_tokens"] > 0
        with open(s.log_path) as f:
            log = f.read()
        decisions = re.findall(r"Scheduler TP(\d+)\] INFO sglang\.srt\.tokenweave\.executor: TokenWeave: (\d+) tokens "
                               r"(split|run unsplit)", log)
        assert any(d[2] == "split" for d in decisions), "no batch was split"
        assert any(d[2] == "run unsplit" for d in decisions), "decode batches should be logged as unsplit"
        assert {d[0] for d in decisions} == {str(r) for r in range(tp)}, "every rank logs its decisions"
        repeated = [k for k, c in collections.Counter(decisions).items() if c > 1]
        assert not repeated, f"(rank, batch size, decision) logged more than once: {repeated}"
        assert log.count("[TokenWeave]") == tp and log.count(f"TwCommunicator(world_size={tp}") == tp, \
            "tw-comm's communicator is the default with --enable-tokenweave (logged per rank)"
        assert log.count("TokenWeaveCommunicator(unsplit forwards: TorchCommunicator(backend=gloo") == tp, \
            "unsplit forwards (decode) run the plain server's communicator, split halves tw-comm's (logged per rank)"
        mode = "full" if full else "sharded"
        assert log.count(f"residual {mode}") == tp, f"the executor's residual mode ({mode}), per rank"
        info = requests.get(s.url + "/get_server_info", timeout=30).json()
        assert info.get("enable_tokenweave") is True
        assert info.get("tokenweave_sharded_residual") is (False if full else None)  # None: the default, sharded
