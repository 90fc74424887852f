"""``--use-ray`` pieces that need no Ray cluster: the placement plan (roles -> bundles), the flags, the clear
error without the ``ray`` package, and that the plain server's modules never import ``ray``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sglang.srt.ray.placement import RoleGroup, plan_placement
from sglang.srt.server_args import ServerArgs, prepare_server_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "python"), os.path.join(REPO, "sgl-kernel",
                                                                                             "python")])}


def test_tp_group_one_node_is_one_strict_pack_bundle():
    (plan,) = plan_placement([RoleGroup("scheduler", 4, 1, {"CPU": 1, "GPU": 1}, extra={"CPU": 1})])
    assert plan.strategy == "STRICT_PACK"
    assert plan.bundles == ({"CPU": 5, "GPU": 4},)
    assert [plan.slots[("scheduler", r)] for r in range(4)] == [0, 0, 0, 0]


def test_tp_group_over_nodes_packs_each_slice_and_spreads_slices():
    (plan,) = plan_placement([RoleGroup("scheduler", 8, 2, {"CPU": 2, "GPU": 1}, extra={"CPU": 1})])
    assert plan.strategy == "STRICT_SPREAD"
    assert plan.bundles == ({"CPU": 9, "GPU": 4}, {"CPU": 8, "GPU": 4})  # extra only on slice 0
    assert [plan.slots[("scheduler", r)] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_roles_get_their_own_groups_or_one_spread_group():
    groups = [RoleGroup("prefill", 2, 1, {"CPU": 1, "GPU": 1}), RoleGroup("decode", 4, 2, {"CPU": 1, "GPU": 1})]
    own = plan_placement(groups)
    assert [(p.name, p.strategy, len(p.bundles)) for p in own] == [("sglang-prefill", "STRICT_PACK", 1),
                                                                    ("sglang-decode", "STRICT_SPREAD", 2)]
    (spread,) = plan_placement(groups, spread_roles=True)
    assert spread.strategy == "STRICT_SPREAD" and len(spread.bundles) == 3
    assert spread.slots[("prefill", 1)] == 0 and spread.slots[("decode", 1)] == 1 and spread.slots[("decode", 2)] == 2
    assert spread.bundles[0] == {"CPU": 2, "GPU": 2} and spread.bundles[2] == {"CPU": 2, "GPU": 2}


@pytest.mark.parametrize("kwargs, needle", [
    (dict(role="x", num_workers=0), "num_workers=0"),
    (dict(role="x", num_workers=3, nnodes=2), "nnodes=2 must divide num_workers=3"),
    (dict(role="x", num_workers=2, resources={"CPU": -1}), "CPU=-1"),
])
def test_bad_role_groups_name_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        RoleGroup(**kwargs)


def test_duplicate_roles_and_empty_plans_are_rejected():
    with pytest.raises(ValueError, match="unique"):
        plan_placement([RoleGroup("a", 1), RoleGroup("a", 1)])
    with pytest.raises(ValueError, match="no role groups"):
        plan_placement([])
    with pytest.raises(ValueError, match="rank 5"):
        RoleGroup("a", 2).slice_of(5)


def test_flags():
    a = prepare_server_args(["--use-ray", "--tp", "2", "--nnodes", "2", "--ray-address", "10.0.0.1:6379",
                             "--ray-spread-roles", "--ray-cpus-per-worker", "2"])
    assert (a.use_ray, a.ray_address, a.ray_spread_roles, a.ray_cpus_per_worker) == (True, "10.0.0.1:6379", True, 2.0)
    assert prepare_server_args([]).ray_address == "auto"  # the running cluster
    with pytest.raises(ValueError, match="dist-init-addr"):  # without Ray, multi-node still needs the address
        ServerArgs(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="ray-placement-timeout"):
        ServerArgs(use_ray=True, ray_placement_timeout=0)


def test_plain_server_modules_never_import_ray():
    code = ("import sys; import sglang, sglang.launch_server, sglang.srt.entrypoints.http_server, "
            "sglang.srt.entrypoints.launch, sglang.srt.entrypoints.engine, sglang.srt.managers.scheduler_process, "
            "sglang.srt.managers.detokenizer_manager, sglang.srt.managers.tokenizer_manager, sglang.srt.ray, "
            "sglang.srt.ray.placement; print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_use_ray_without_ray_says_how_to_install():
    code = ("import sys; sys.modules['ray'] = None\n"  # as if the extra were not installed
            "from sglang.srt.entrypoints.launch import launch_subprocesses\n"
            "from sglang.srt.server_args import PortArgs, ServerArgs\n"
            "try:\n    launch_subprocesses(ServerArgs(model_path='x', use_ray=True, device='cpu'), "
            "PortArgs.init_new('tcp'))\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert "--use-ray needs Ray" in out.stdout and "sglang[ray]" in out.stdout, out.stdout + out.stderr


def test_worker_resources_pin_instances_and_are_validated():
    a = ServerArgs(use_ray=True, ray_worker_resources='{"node_a": 0.01}', device="cpu")
    assert a.ray_extra_resources() == {"node_a": 0.01}
    assert ServerArgs().ray_extra_resources() == {}
    for bad in ('{"node_a": -1}', "[1]", "node_a", '{"GPU": 1}'):
        with pytest.raises(ValueError, match="ray-worker-resources"):
            ServerArgs(ray_worker_resources=bad)
    (plan,) = plan_placement([RoleGroup("prefill", 2, 1, {"CPU": 1, **a.ray_extra_resources()}, extra={"CPU": 1})])
    assert plan.bundles == ({"CPU": 3, "node_a": 0.02},)  # the bundle (and so the node) must offer node_a
