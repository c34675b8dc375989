"""Serve tests: apps on a local Ray (tests/support/serve_apps.py), the cluster layer, the
monitoring stack, and the ingress driven outside Serve."""

from pathlib import Path

import pytest

from tests.support.tiers import mark_folder, ray_modules

# The modules that start a local Ray (or a Ray cluster).
SLOW = ray_modules("serve")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, Path(__file__).parent, slow=SLOW)


@pytest.fixture
def outside_serve(monkeypatch):
    """No Ray metrics and no GC tuning: what an ingress needs of Serve's process."""
    import cluster.ingress as ingress
    from tests.support.outside_serve import NoMetrics

    monkeypatch.setattr(ingress, "RayMetricsSink", NoMetrics)
    monkeypatch.setattr(ingress, "tune_for_serving", lambda: None)
