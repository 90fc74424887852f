"""The deployment plan: every technique resolved once into frozen worker specs; ``--dry-run`` prints it;
bad combinations and missing optional packages fail before any process starts; the technique flags are read
nowhere in the core layers."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.srt.deployment import (
    MissingPackageError,
    WorkerRole,
    plan_deployment,
    render_plan,
    single_worker_spec,
)
from sglang.srt.server_args import PortArgs, ServerArgs

SRT = Path(__file__).resolve().parents[2] / "python" / "sglang" / "srt"
TECHNIQUE_FLAGS = ("enable_tokenweave", "enable_afd", "enable_tdist_overlap", "disaggregation_mode", "use_ray",
                   "comm_backend", "moe_a2a_backend", "enable_two_batch_overlap", "tbo_min_tokens",
                   "tbo_token_distribution_threshold", "enable_dp_attention")
CORE = ("managers", "entrypoints", "model_executor", "layers", "models")


def _plan(**kw):
    return plan_deployment(ServerArgs(device="cpu", **kw))


def _shape(plan):
    return [(w.role, w.group, w.rank, w.tp_size, w.node, w.executor.name, w.communicator.tokenweave,
             w.connector.side if w.connector else None) for w in plan.workers]


def test_aggregated_tp_plan():
    plan = _plan(tp_size=2)
    A = WorkerRole.AGGREGATED
    assert _shape(plan) == [(A, 0, 0, 2, 0, "sequential", False, None), (A, 0, 1, 2, 0, "sequential", False, None)]
    assert [w.name for w in plan.workers] == ["sglang::scheduler_TP0", "sglang::scheduler_TP1"]
    assert plan.launcher == "multiprocessing" and plan.techniques == () and plan.detokenizer
    assert [w.device for w in plan.workers] == ["cpu", "cpu"]


def test_multinode_plan_lists_this_nodes_ranks_only():
    plan = _plan(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert [(w.rank, w.local_index, w.node) for w in plan.workers] == [(2, 0, 1), (3, 1, 1)]
    assert not plan.detokenizer  # node 0 runs it


@pytest.mark.parametrize("kw, executor, tokenweave", [
    (dict(enable_tokenweave=True, tp_size=2, tokenweave_min_tokens=64), "tokenweave", True),
    (dict(comm_backend="tw", tp_size=2), "sequential", False),
    (dict(enable_tdist_overlap=True, tp_size=2), "tdist_sp", False),
])
def test_executor_and_communicator_techniques(kw, executor, tokenweave):
    plan = _plan(**kw)
    assert {w.executor.name for w in plan.workers} == {executor}
    assert {w.communicator.tokenweave for w in plan.workers} == {tokenweave}
    assert {w.communicator.backend for w in plan.workers} == {kw.get("comm_backend", "auto")}
    if executor == "tokenweave":
        assert plan.workers[0].executor.opts()["min_tokens"] == 64


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("extra", [{}, {"enable_tokenweave": True}, {"enable_tdist_overlap": True}])
def test_pd_workers_run_with_their_real_role(mode, extra):
    plan = _plan(disaggregation_mode=mode, disaggregation_transfer_backend="fake", disaggregation_transfer_mode="push",
                 tp_size=2, **extra)
    assert {w.role for w in plan.workers} == {WorkerRole(mode)}
    assert {(w.connector.side, w.connector.transfer_backend, w.connector.transfer_mode) for w in plan.workers} == {
        (WorkerRole(mode), "fake", "push")}
    assert "pd" in plan.techniques


def test_afd_plan_places_attention_groups_then_ffn_workers():
    plan = _plan(enable_afd=True, afd_attention_workers=2, afd_ffn_workers=3, tp_size=2, afd_micro_batches=3)
    att, ffn = plan.schedulers, plan.ffn_workers
    assert [(w.role, w.group, w.rank, w.local_index) for w in att] == [
        (WorkerRole.ATTENTION, a, r, a * 2 + r) for a in range(2) for r in range(2)]
    assert [(w.role, w.rank, w.local_index, w.tp_size) for w in ffn] == [
        (WorkerRole.FFN, j, 4 + j, 1) for j in range(3)]
    assert {w.executor.opts()["micro_batches"] for w in att} == {3}
    assert plan.scheduler_groups == 2 and plan.stay_up_on_worker_death
    assert any("inline" in n for n in plan.notes)  # CPU: auto -> inline


def test_ray_plan_covers_every_node_slice():
    plan = _plan(use_ray=True, tp_size=4, nnodes=2)
    assert plan.launcher == "ray" and plan.zmq_transport == "tcp"
    assert [(w.rank, w.node, w.local_index) for w in plan.workers] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    ray_afd = _plan(use_ray=True, enable_afd=True, afd_attention_workers=2)
    assert [w.role for w in ray_afd.workers] == [WorkerRole.ATTENTION, WorkerRole.ATTENTION, WorkerRole.FFN]
    assert ray_afd.techniques == ("afd", "ray")


def test_afd_transport_has_one_auto_rule():
    from sglang.srt.afd.deploy import transport

    cpu, gpu = ServerArgs(device="cpu"), ServerArgs(device="cuda")
    assert [transport(cpu, True), transport(cpu, False)] == ["inline", "inline"]
    assert [transport(gpu, True), transport(gpu, False)] == ["cuda_ipc", "nccl"]
    assert transport(ServerArgs(device="cuda", afd_transport="nccl"), True) == "nccl"
    assert transport(ServerArgs(device="cuda", afd_transport="cuda_push_ll"), True) == "cuda_push_ll"  # explicit only
    assert transport(ServerArgs(device="cuda", tp_ranks_share_gpu=True), True) == "cuda_ipc"  # one shared GPU
    for path in (SRT / "entrypoints", SRT / "ray", SRT / "deployment"):  # nobody else resolves "auto"
        for p in path.rglob("*.py"):
            assert "afd_transport ==" not in p.read_text(), p


@pytest.mark.parametrize("kw, flags", [
    (dict(enable_afd=True, disaggregation_mode="prefill", disaggregation_transfer_backend="fake"),
     ("--enable-afd", "--disaggregation-mode")),
    (dict(enable_afd=True, enable_tdist_overlap=True), ("--enable-tdist-overlap", "--enable-afd")),
    (dict(use_ray=True, node_rank=1, nnodes=2), ("--node-rank", "--use-ray")),
])
def test_invalid_combination_fails_before_any_process_names_both_flags(kw, flags, monkeypatch):
    import sglang.srt.entrypoints.launch as launch

    def no_spawn(*a, **k):
        raise AssertionError("a process was about to start")

    monkeypatch.setattr(launch, "MultiprocessingLauncher", no_spawn)
    args = ServerArgs(device="cpu", model_path="unused", **kw)
    with pytest.raises(ValueError) as e:
        launch.launch_subprocesses(args, PortArgs.init_new("tcp"))
    assert all(f in str(e.value) for f in flags), str(e.value)


@pytest.mark.parametrize("kw", [dict(enable_tokenweave=True, enable_tdist_overlap=True),
                                dict(enable_afd=True, enable_tokenweave=True)])
def test_combinations_refused_by_server_args_name_both_flags(kw):
    with pytest.raises(ValueError) as e:
        ServerArgs(**kw)
    names = [k.replace("_", "-") for k in kw]
    assert all(n in str(e.value) for n in names), str(e.value)


@pytest.mark.parametrize("kw, flag, module", [
    (dict(enable_afd=True), "--enable-afd", "sgl_kernel"),
    (dict(enable_tokenweave=True), "--enable-tokenweave", "sgl_kernel"),
    (dict(comm_backend="tw"), "--comm-backend tw", "sgl_kernel"),
    (dict(use_ray=True), "--use-ray", "ray"),
    (dict(disaggregation_mode="decode"), "--disaggregation-transfer-backend nixl", "nixl"),
    (dict(enable_tdist_overlap=True), "--enable-tdist-overlap", "triton"),
])
def test_missing_optional_package_fails_with_one_line(kw, flag, module, monkeypatch):
    real = importlib.util.find_spec
    missing = {module} | ({"nixl_cu13", "nixl_cu12"} if module == "nixl" else set())
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    with pytest.raises(MissingPackageError) as e:
        _plan(**kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(flag) and "install" in msg and module in msg, msg
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, ValueError)


def test_afd_nixl_transport_needs_nixl(monkeypatch):
    real = importlib.util.find_spec
    missing = {"nixl", "nixl_cu13", "nixl_cu12"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    import sglang.srt.disaggregation.transfer.base as tb

    monkeypatch.setattr(tb, "nixl_available", lambda: (True, ""))  # ServerArgs' own check passes
    with pytest.raises(MissingPackageError, match=r"^--afd-transport nixl needs NIXL.*pip install 'sglang\[pd\]'"):
        _plan(enable_afd=True, afd_transport="nixl")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a))
    if any(real(n) for n in ("nixl_cu13", "nixl_cu12")):  # a CUDA-specific NIXL wheel alone is enough
        _plan(enable_afd=True, afd_transport="nixl")


@pytest.mark.parametrize("argv, want", [
    ([], ["sglang::scheduler ", "aggregated", "sequential", "sglang::detokenizer"]),
    (["--tp", "2", "--enable-tokenweave"], ["sglang::scheduler_TP1", "tokenweave(", "auto [tokenweave]"]),
    (["--tp", "2", "--enable-tdist-overlap"], ["tdist_sp"]),
    (["--enable-afd", "--afd-ffn-workers", "2"], ["attention", "sglang::ffn1", "afd(", "auto -> inline"]),
    (["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "fake"], ["prefill", "pd-prefill"]),
    (["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake", "--enable-tokenweave", "--tp",
      "2"], ["decode", "pd-decode", "tokenweave("]),
    (["--use-ray", "--tp", "2", "--nnodes", "2"], ["launcher ray", "ray"]),
    (["--use-ray", "--enable-afd", "--afd-attention-workers", "2"], ["attention1", "afd, ray"]),
])
def test_dry_run_prints_the_plan(argv, want, capsys):
    from sglang.launch_server import main

    assert main(["--dry-run", "--device", "cpu", *argv]) == 0
    out = capsys.readouterr().out
    assert out.startswith("deployment plan:"), out
    for w in want:
        assert w in out, (w, out)


def test_dry_run_refuses_a_bad_combination(capsys):
    from sglang.launch_server import main

    assert main(["--dry-run", "--device", "cpu", "--enable-afd", "--disaggregation-mode", "decode",
                 "--disaggregation-transfer-backend", "fake"]) == 2
    out = capsys.readouterr()
    assert "--enable-afd" in out.err and "--disaggregation-mode" in out.err and "deployment plan" not in out.out


def test_dry_run_cli_exits_zero():
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--dry-run", "--device", "cpu", "--tp", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sglang::scheduler_TP1" in out.stdout and "sglang::detokenizer" in out.stdout


def test_plan_is_frozen_and_render_has_a_row_per_process():
    plan = _plan(tp_size=2)
    with pytest.raises(Exception):
        plan.workers[0].rank = 5  # type: ignore[misc]
    lines = render_plan(plan).splitlines()
    assert sum("sglang::" in line for line in lines) == 3  # two ranks and the detokenizer


def test_every_planned_executor_is_registered():
    from sglang.srt.model_executor.executors.registry import build_executor, registered_executors

    for kw in (dict(), dict(enable_tokenweave=True), dict(enable_tdist_overlap=True), dict(enable_afd=True)):
        for w in _plan(**kw).schedulers:
            assert w.executor.name in registered_executors()
    from sglang.srt.deployment.plan import ExecutorSpec

    with pytest.raises(ValueError, match="unknown executor 'nope'"):
        build_executor(ExecutorSpec("nope"))


def test_single_worker_spec_matches_the_plan_template():
    args = ServerArgs(device="cpu", enable_tokenweave=True, tp_size=2)
    assert single_worker_spec(args).executor == plan_deployment(args).workers[0].executor
    assert single_worker_spec(args, WorkerRole.FFN).role is WorkerRole.FFN


def test_local_wiring_gives_each_scheduler_group_its_endpoints():
    from sglang.srt.deployment.wiring import wire_local

    args = ServerArgs(device="cpu", enable_afd=True, afd_attention_workers=2, afd_ffn_workers=2, tp_size=2)
    pa = PortArgs.init_new("ipc")
    ports = iter(range(41000, 41010))
    bound, front = wire_local(plan_deployment(args), args, pa, lambda: next(ports))
    att = [w for w in bound if w.is_scheduler]
    assert front.dp_scheduler_inputs == tuple(att[a * 2].wiring.port_args.scheduler_input_ipc for a in range(2))
    assert len({w.wiring.dist_init for w in att}) == 2  # one TP rendezvous per attention worker
    assert {w.wiring.afd_topology for w in bound} == {bound[0].wiring.afd_topology}
    assert bound[0].wiring.afd_topology.transport == "inline" and len(bound[0].wiring.afd_topology.addresses) == 4


def _flag_reads(path: Path) -> list:
    """``x.<technique flag>`` attribute reads in one file."""
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(SRT)}:{n.lineno} .{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in TECHNIQUE_FLAGS]


def test_technique_flags_are_read_only_by_the_plan_and_technique_packages():
    """The issue's grep: no technique flag in managers/, entrypoints/, model_executor/, layers/, models/."""
    pattern = re.compile(r"\b(" + "|".join(TECHNIQUE_FLAGS) + r")\b")
    hits = [f"{p.relative_to(SRT)}:{i}" for d in CORE for p in (SRT / d).rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, f"technique flags read outside the plan and the technique packages: {hits}"
    assert not [h for d in CORE for p in (SRT / d).rglob("*.py") for h in _flag_reads(p)]


def _top_level_imports(path: Path) -> set:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_core_entrypoints_do_not_import_ray_at_module_level():
    bad = {p.name: sorted(n for n in _top_level_imports(p) if n == "ray" or n.startswith(("ray.", "sglang.srt.ray")))
           for p in (SRT / "entrypoints").rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_ray_imports_no_private_names_from_core():
    bad = []
    for p in (SRT / "ray").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang.srt") and \
                    not node.module.startswith("sglang.srt.ray"):
                bad += [f"{p.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, bad


def test_one_role_vocabulary():
    defs = [p.relative_to(SRT).as_posix() for p in SRT.rglob("*.py") if "class WorkerRole" in p.read_text()]
    assert defs == ["deployment/plan.py"], defs
    assert [r.value for r in WorkerRole] == ["aggregated", "prefill", "decode", "attention", "ffn"]


def test_server_args_help_has_one_source():
    import dataclasses

    from sglang.srt.server_args_help import SERVER_ARGS_HELP

    assert {f.name for f in dataclasses.fields(ServerArgs)} <= set(SERVER_ARGS_HELP)
    assert "helps = {" not in (SRT / "server_args.py").read_text()
