"""The sharded residual (TokenWeave's default; ``--tokenweave-full-residual`` turns it off) on gloo TP ranks (CPU):
TokenWeave's split forwards keep the residual sharded (TokenWeave, Gond et al. 2025, sec. 3-4: each rank reads and
updates only its ``owned_range`` rows of each split's residual and all-gathers only the normed rows).

* the communicator: the sharded call's normed rows and owned residual rows equal the full call's bit for bit (same
  fp32 reduce and norm), rows it does not own are left as they were, and ``out=`` works as before;
* the executor on the real stories260K checkpoints at TP 2 (cut at every token boundary of prefill, mixed and decode
  steps), with every rank's non-owned residual rows NaN-filled after each sharded call: the logits equal the
  full-residual run's exactly (so no consumer reads a stale row) and the single-process logits within tolerance;
* the flags: the default and ``--tokenweave-sharded-residual`` give the sharded residual, ``--tokenweave-full-residual``
  the full one; either flag without ``--enable-tokenweave`` is refused, neither is needed without it;
* the fail-closed model check: norms with different communicators are refused at executor setup.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from tp_worker import spawn_ranks, tokenweave_full_and_sharded  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "..", "..", "shared", "data", "models")


def _rank_sharded_call(ps):
    from sgl_kernel.tw_comm.reference import owned_range

    from sglang.srt.distributed.tw_communicator import TwCommunicator

    gen = torch.Generator().manual_seed(200 + ps.tp_rank)
    shared = torch.Generator().manual_seed(9)
    comm = TwCommunicator(ps)
    bad = []
    for tokens in (1, 2, 3, 8, 13):
        x = torch.randn(tokens, 32, generator=gen)
        res = torch.randn(tokens, 32, generator=shared)
        w = torch.rand(32, generator=shared) + 0.5
        full_n, full_r = comm.all_reduce_add_rmsnorm(x.clone(), res.clone(), w, 1e-6)
        big = torch.full((tokens + 1, 32), float("nan"))
        sh_n, sh_r = comm.all_reduce_add_rmsnorm(x.clone(), res.clone(), w, 1e-6, out=big[1:], residual_sharded=True)
        s, e = owned_range(tokens, ps.tp_size, ps.tp_rank)
        if not torch.equal(sh_n, full_n) or sh_n.data_ptr() != big[1:].data_ptr():
            bad.append(f"T={tokens}: normed rows differ or not written into out")
        if not torch.equal(sh_r[s:e], full_r[s:e]):
            bad.append(f"T={tokens}: owned residual rows differ")
        if not (torch.equal(sh_r[:s], res[:s]) and torch.equal(sh_r[e:], res[e:])):
            bad.append(f"T={tokens}: a non-owned residual row changed")
        # a chain of sharded calls on the same rows (as a split forward's layers) with stale rows poisoned
        chain_full, chain_sh = res.clone(), res.clone()
        for layer in range(3):
            xl = torch.randn(tokens, 32, generator=gen)
            nf, chain_full = comm.all_reduce_add_rmsnorm(xl.clone(), chain_full, w, 1e-6)
            ns, chain_sh = comm.all_reduce_add_rmsnorm(xl.clone(), chain_sh, w, 1e-6, residual_sharded=True)
            chain_sh[:s], chain_sh[e:] = float("nan"), float("nan")
            if not torch.equal(nf, ns):
                bad.append(f"T={tokens} layer {layer}: chained normed rows differ")
    return bad


def test_sharded_call_equals_full_call_tp2():
    for rank, bad in enumerate(spawn_ranks(_rank_sharded_call, 2)):
        assert not bad, f"rank {rank}: {bad}"


def test_sharded_call_tp4():
    for rank, bad in enumerate(spawn_ranks(_rank_sharded_call, 4)):
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("name", ["stories260K", "stories260K-moe"])
def test_sharded_residual_logits_equal_full_tp2(name):
    path = os.path.join(MODELS, name)
    if not os.path.isdir(path):
        pytest.skip(f"{path} is missing")
    pytest.importorskip("transformers")
    from test_tp_models import ATOL, RTOL, _reference

    ref = _reference(path)
    results = spawn_ranks(tokenweave_full_and_sharded, 2, [path], timeout=400)
    for rank, [(full, sharded, calls)] in enumerate(results):
        assert calls > 0, f"rank {rank}: no residual-sharded call was made"
        for step, (f_cuts, s_cuts, want) in enumerate(zip(full, sharded, ref)):
            assert len(f_cuts) == len(s_cuts) and (len(s_cuts) >= 2 or step >= 2)
            for cut, (f, s) in enumerate(zip(f_cuts, s_cuts), start=1):
                assert torch.isfinite(s).all(), f"rank {rank} step {step} cut {cut}: a stale residual row was read"
                assert torch.equal(s, f), f"rank {rank} step {step} cut {cut}: sharded != full residual logits"
                torch.testing.assert_close(s, want, atol=ATOL, rtol=RTOL)


def test_flag_parsed_validated_and_carried():
    from sglang.srt.server_args import ServerArgs, prepare_server_args
    from sglang.srt.tokenweave.deploy import executor

    base = ["--model-path", "m", "--tp", "2"]
    for flags, field, sharded in (([], None, True), (["--tokenweave-sharded-residual"], True, True),
                                  (["--tokenweave-full-residual"], False, False)):
        sa = prepare_server_args(base + ["--enable-tokenweave", *flags])
        assert sa.tokenweave_sharded_residual is field and sa.resolved_tokenweave_sharded_residual is sharded, flags
        assert executor(sa).opts()["sharded_residual"] is sharded, flags
    plain = prepare_server_args(base)  # TokenWeave off, no residual flag: nothing to refuse, nothing sharded
    assert plain.tokenweave_sharded_residual is None and not plain.resolved_tokenweave_sharded_residual
    assert executor(plain) is None
    for field, flag in ((True, "tokenweave-sharded-residual"), (False, "tokenweave-full-residual")):
        with pytest.raises(ValueError, match=flag):
            ServerArgs(model_path="m", tp_size=2, tokenweave_sharded_residual=field)
    with pytest.raises(SystemExit):  # argparse: the two flags are mutually exclusive
        prepare_server_args(base + ["--enable-tokenweave", "--tokenweave-sharded-residual",
                                    "--tokenweave-full-residual"])


def test_optional_bool_round_trips_through_cli_and_dict():
    """Every ``Optional[bool]`` field (None / True / False) survives ServerArgs -> dict -> ``sgl.Runtime``'s command
    line -> ServerArgs and ServerArgs -> dict -> ServerArgs (Engine kwargs): False must become its own flag
    (``--tokenweave-full-residual``), not be dropped (which would silently start the sharded default)."""
    import dataclasses

    from sglang.lang.runtime import server_cli_args
    from sglang.srt.server_args import FALSE_FLAGS, ServerArgs, prepare_server_args

    for value in (None, True, False):
        sa = ServerArgs(model_path="m", tp_size=2, enable_tokenweave=True, tokenweave_sharded_residual=value)
        d = dataclasses.asdict(sa)
        assert ServerArgs(**d) == sa
        argv = server_cli_args({"model_path": "m", "tp_size": 2, "enable_tokenweave": True,
                                "tokenweave_sharded_residual": value})
        assert ("--tokenweave-full-residual" in argv) is (value is False), argv
        back = prepare_server_args(argv)
        assert back.tokenweave_sharded_residual is value and back == sa, argv
    assert set(FALSE_FLAGS) == {f.name for f in dataclasses.fields(ServerArgs) if str(f.type) == "Optional[bool]"}


class _Comm:
    """A communicator stand-in with TokenWeave's capability flags."""

    supports_overlap = True

    def __init__(self, sharded: bool = True):
        self.supports_sharded_residual = sharded


def _model(layer_comm, final_comm, layers: int = 2):
    """A staged-model stand-in: ``layers`` decoder layers whose norms use ``layer_comm`` and a final norm
    (``model.norm``) using ``final_comm``."""
    from types import SimpleNamespace

    from torch import nn

    from sglang.srt.layers.layernorm import RMSNorm

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm(8, comm=layer_comm)
            self.post_attention_layernorm = RMSNorm(8, comm=layer_comm)

        def norm_module(self, stage):
            return {"input_norm": self.input_layernorm, "post_attention_norm": self.post_attention_layernorm}[stage]

    return SimpleNamespace(decoder_layers=[Layer() for _ in range(layers)],
                           model=SimpleNamespace(norm=RMSNorm(8, comm=final_comm)))


def test_sharded_residual_refuses_a_final_norm_with_another_communicator():
    """Fail closed: with the sharded residual, a final norm (or a layer norm) whose communicator differs from the
    others' is refused at executor setup (``make_executor`` with the loaded model) and before a split forward, with
    a message naming the norm and ``--tokenweave-full-residual``; the full residual, one shared communicator, and
    norms none of whose communicators can shard are accepted."""
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.deployment.plan import ExecutorSpec
    from sglang.srt.tokenweave.deploy import make_executor
    from sglang.srt.tokenweave.executor import TokenWeaveConfig, TokenWeaveExecutor

    def ex(sharded=True):
        return TokenWeaveExecutor(TokenWeaveConfig(gemm_widths=(8,), sharded_residual=sharded), torch.device("cpu"))

    comm = _Comm()
    ex().check_model(_model(comm, comm))  # today's models: one communicator for every norm
    ex(False).check_model(_model(comm, _Comm()))  # full residual: nothing is sharded
    ex().check_model(_model(_Comm(False), _Comm(False)))  # no communicator can shard: nothing is sharded
    for bad, where in ((_model(comm, _Comm()), "the final norm"), (_model(comm, None), "the final norm"),
                       (_model(_Comm(False), comm), "the final norm")):
        with pytest.raises(ValueError, match=f"{where}.*--tokenweave-full-residual"):
            ex().check_model(bad)
    odd_layer = _model(comm, comm)
    odd_layer.decoder_layers[1].post_attention_layernorm.comm = _Comm()
    with pytest.raises(ValueError, match="layer 1 post_attention_norm"):
        ex().check_model(odd_layer)
    with pytest.raises(ValueError, match="layer 1 post_attention_norm"):  # the guard before a split forward
        ex().run_subs(odd_layer, SimpleNamespace(), [SimpleNamespace(), SimpleNamespace()])
    # the server's factory checks the loaded model once it is built
    cfg = ModelConfig.from_path(os.path.join(MODELS, "stories260K")) if os.path.isdir(MODELS) else None
    if cfg is None:
        pytest.skip(f"{MODELS} is missing")
    ctx = SimpleNamespace(model_config=cfg, device=torch.device("cpu"), tp_size=2, model=_model(comm, _Comm()))
    with pytest.raises(ValueError, match="the final norm"):
        make_executor(ExecutorSpec.of("tokenweave", min_tokens=None, comm_sms=None, sharded_residual=True), ctx)
    ctx.model = _model(comm, comm)
    assert make_executor(ExecutorSpec.of("tokenweave", min_tokens=None, comm_sms=None), ctx).config.sharded_residual


@pytest.mark.parametrize("picked,bulk,want", [
    ("p2p_oneshot", None, "p2p_twoshot"), ("p2p_lamport", None, "p2p_twoshot"),
    ("p2p_lamport", True, "p2p_twoshot_bulk"),
    ("p2p_twoshot", None, "p2p_twoshot"), ("p2p_twoshot_pipe", None, "p2p_twoshot_pipe"),
    ("p2p_twoshot_bulk", None, "p2p_twoshot_bulk"), ("ce", None, "ce"), ("nccl", None, None)])
def test_sharded_backend_only_owned_row_kernels(picked, bulk, want):
    """A residual-sharded call never runs a kernel that reads every residual row (one-shot, Lamport): those picks
    become the two-shot kernel; a pick with no sharded form (NCCL: no staging room) goes to the torch fallback."""
    from types import SimpleNamespace

    from sglang.srt.distributed.tw_comm import TwBackend, TwCommConfig
    from sglang.srt.distributed.tw_communicator import TwCommunicator

    comm = TwCommunicator(None)
    comm.ws = SimpleNamespace(select=lambda *a: TwBackend(picked), config=TwCommConfig(bulk_twoshot=bulk))
    kw = comm._sharded_backend(64, 8192, True, 2)
    assert (None if kw is None else kw["backend"].value) == want
    assert kw is None or kw["residual_sharded"] is True
