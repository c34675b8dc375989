"""Test tiers: which tests are slow on a CPU (named by each folder's conftest.py, left out of
the fast lane `pytest -m "not gpu and not slow"`), and how xdist shares the tests between
its workers (`-n 2 --dist loadgroup`, scheduled by `make_scheduler`).

The modules that start Ray form two groups, each run by one worker on that worker's own
local Ray instance (start_ray picks free ports): most Serve apps in one, and in the other
the engine's actor groups (TP/PP ranks, no Serve app) and the autoscaling app, which spends
most of its time waiting out Serve's delays. The first group is the run's longest path;
the second overlaps its waits with the other worker's CPU-bound tests. Any other module
is a group of its own, so
that its module-scoped fixtures (a loaded model, a deployed app) are built once; the tests
of a folder without such fixtures go one by one to whichever worker is free.

The groups are read off the test ids here, not off `xdist_group` marks: under pytest 9.2
xdist 3.8 drops the group its workers append to an id (pytest-dev/pytest-xdist#1386).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import pytest

# Modules (under tests/) that start a local Ray instance or a Ray cluster.
RAY_MODULES = frozenset(
    {
        "engine/test_parallel.py",
        "serve/test_cluster.py",
        "serve/test_cluster_serve.py",
        "serve/test_metrics_prometheus.py",
        "serve/test_readme_examples.py",
        "serve/test_replica_failures.py",
        "serve/test_serve_autoscale.py",
        "serve/test_serve_colocated.py",
        "serve/test_serve_direct_ingress.py",
        "serve/test_serve_http_surface.py",
        "serve/test_serve_model_admin.py",
        "serve/test_serve_multi_model.py",
        "serve/test_serve_openai.py",
        "serve/test_serve_prefix_routing.py",
    }
)
RAY_GROUP = "ray"
# Of RAY_MODULES, those run beside the Serve apps' group, on the other worker's Ray.
RAY_SECOND_MODULES = frozenset({"engine/test_parallel.py", "serve/test_serve_autoscale.py"})
RAY_SECOND_GROUP = "ray-second"
# Folders whose tests share no module-scoped fixture: spread test by test.
SPREAD_FOLDERS = frozenset({"kernels", "unit"})
EVERY_MODULE = "*"


def ray_modules(folder: str) -> set[str]:
    """The file names of `folder`'s modules that start Ray."""
    return {m.split("/", 1)[1] for m in RAY_MODULES if m.startswith(f"{folder}/")}


def xdist_group(nodeid: str) -> str:
    """The group a test id belongs to: a Ray group, its module, or itself."""
    module = nodeid.split("::", 1)[0].removeprefix("tests/")
    if module in RAY_SECOND_MODULES:
        return RAY_SECOND_GROUP
    if module in RAY_MODULES:
        return RAY_GROUP
    if module.split("/", 1)[0] in SPREAD_FOLDERS:
        return nodeid
    return module


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduling by scope, with `xdist_group` as the scope: larger groups go out
    first, and a worker takes the next group when it is nearly done with its own."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return TierScheduling(config, log)


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
    gpu: Collection[str] = (),
) -> None:
    """Mark the tests of `folder` (a conftest's own) `slow` or `gpu` where those name their
    module or the test; `fast` names the quick tests of a slow module."""
    for item in items:
        if item.path.parent != folder:
            continue
        if _named(item, slow) and not _named(item, fast):
            item.add_marker(pytest.mark.slow)
        if _named(item, gpu):
            item.add_marker(pytest.mark.gpu)
