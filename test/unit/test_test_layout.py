"""The test tree's module names are unique: the test folders are not packages, so pytest imports every test file by
its basename and a second file of the same name in another folder fails the whole collection ("import file
mismatch"), which stops CI before any test runs."""

from __future__ import annotations

import collections
from pathlib import Path

TEST_ROOT = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    seen = collections.defaultdict(list)
    for p in TEST_ROOT.rglob("*.py"):
        if "__pycache__" not in p.parts:
            seen[p.name].append(str(p.relative_to(TEST_ROOT)))
    dups = {name: paths for name, paths in seen.items() if len(paths) > 1 and name != "__init__.py"}
    assert not dups, f"test modules with the same basename (rename one): {dups}"
