"""The parallel-run plan (``test/parallel_plan.py``): every file it names exists (a renamed file would silently drop
out of the heavy-first order or out of its must-not-overlap group), work units are files or groups, and the heavy
files sort first with each file's own test order kept."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import parallel_plan  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))


def test_named_files_exist():
    groups = set(parallel_plan.SHARED_GROUPS.values())
    for path in parallel_plan.SHARED_GROUPS:
        assert os.path.isfile(os.path.join(REPO, path)), path
    for unit in parallel_plan.HEAVY_FIRST:
        assert unit in groups or os.path.isfile(os.path.join(REPO, unit)), unit
    assert len(set(parallel_plan.HEAVY_FIRST)) == len(parallel_plan.HEAVY_FIRST)


def test_work_units_are_files_or_groups():
    path, group = next(iter(parallel_plan.SHARED_GROUPS.items()))
    assert parallel_plan.work_unit(f"{path}::test_x[a-b]") == group
    assert parallel_plan.work_unit("test/unit/test_zzz.py::Test::test_y") == "test/unit/test_zzz.py"


def test_heavy_files_first_each_file_in_its_own_order():
    heavy = parallel_plan.HEAVY_FIRST[0]
    heavy_path = next((p for p, g in parallel_plan.SHARED_GROUPS.items() if g == heavy), heavy)
    ids = ["test/unit/test_aaa.py::t1", f"{heavy_path}::t1", "test/unit/test_aaa.py::t2", f"{heavy_path}::t2"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    parallel_plan.heavy_first(items)
    assert [i.nodeid for i in items] == [ids[1], ids[3], ids[0], ids[2]]
