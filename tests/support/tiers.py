"""Test tiers, named by each folder's conftest.py: which tests are slow on a CPU (left out of
the fast lane, `pytest -m "not gpu and not slow"`), and which modules start Ray.

Tests also get xdist groups (run with `--dist loadgroup`): the modules that start Ray share
one group, so one worker runs them all on its one local Ray instance while the other runs
the rest; any other module is a group of its own, so that its module-scoped fixtures (a
loaded model, a deployed app) are built by one worker, once. A folder without such fixtures
leaves its tests ungrouped, to be spread test by test.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from pathlib import Path

import pytest

RAY_GROUP = "ray"
EVERY_MODULE = "*"


def _named(item: pytest.Item, names: Collection[str]) -> bool:
    """Whether `names` holds the item's module ("test_x.py"), the test ("test_x.py::test_y",
    all of its parameters), or EVERY_MODULE."""
    module = item.path.name
    test = f"{module}::{getattr(item, 'originalname', item.name)}"
    return EVERY_MODULE in names or module in names or test in names


def mark_folder(
    items: Iterable[pytest.Item],
    folder: Path,
    slow: Collection[str] = (),
    fast: Collection[str] = (),
    ray: Collection[str] = (),
    gpu: Collection[str] = (),
    group_by_module: bool = True,
) -> None:
    """Mark the tests of `folder` (a conftest's own): `slow`, `gpu` and the Ray group for
    the modules or tests those name (`fast` names the quick tests of a slow module). Unless `group_by_module` is off (a folder without
    module-scoped fixtures), every other test gets its module as its xdist group."""
    for item in items:
        if item.path.parent != folder:
            continue
        if _named(item, slow) and not _named(item, fast):
            item.add_marker(pytest.mark.slow)
        if _named(item, gpu):
            item.add_marker(pytest.mark.gpu)
        if _named(item, ray):
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
        elif group_by_module:
            module = item.path.relative_to(folder.parent).as_posix()
            item.add_marker(pytest.mark.xdist_group(module))
