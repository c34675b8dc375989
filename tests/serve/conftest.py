"""Serve tests: apps on a local Ray (tests/support/serve_apps.py), the cluster layer, the
monitoring stack, and the ingress driven outside Serve."""

from pathlib import Path

import pytest

from tests.support.tiers import mark_folder

# Modules that start a local Ray (or a Ray cluster): one xdist worker runs them all.
RAY = {
    "test_cluster.py",
    "test_cluster_serve.py",
    "test_metrics_prometheus.py",
    "test_serve_autoscale.py",
    "test_serve_colocated.py",
    "test_serve_direct_ingress.py",
    "test_serve_multi_model.py",
    "test_serve_openai.py",
}
SLOW = RAY


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, Path(__file__).parent, slow=SLOW, ray=RAY)


@pytest.fixture
def outside_serve(monkeypatch):
    """No Ray metrics and no GC tuning: what an ingress needs of Serve's process."""
    import cluster.deployments as deployments
    from tests.support.outside_serve import NoMetrics

    monkeypatch.setattr(deployments, "RayMetricsSink", NoMetrics)
    monkeypatch.setattr(deployments, "tune_for_serving", lambda: None)
