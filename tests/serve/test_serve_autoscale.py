"""LLMServer autoscaling: 1 -> 2 replicas under a burst, back to 1 when idle.

Runs with the fast autoscaler settings (metrics every 0.5 s, 1 s upscale delay, 5 s
downscale delay) and dummy weights, which load faster than the real checkpoint.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.support.serve_apps import running_replicas, served_app

APP = "autoscale"
ARGS = {
    "load_format": "dummy",
    "max_model_len": 128,
    "max_num_seqs": 4,
    "num_cpus": 0.25,
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 1,
    "max_ongoing_requests": 4,
    "upscale_delay_s": 1,
    "downscale_delay_s": 5,
    "look_back_period_s": 2,
    "metrics_interval_s": 0.5,
    "ingress_max_replicas": 1,
}


@pytest.fixture(scope="module")
def url():
    with served_app(APP, ARGS) as base_url:
        yield base_url


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return False


def test_burst_scales_llm_server_up_and_idle_scales_it_down(url):
    assert running_replicas(APP) == 1
    stop = threading.Event()
    errors: list[str] = []

    def keep_busy():
        body = {"prompt": [1, 2, 3, 4], "max_tokens": 8, "ignore_eos": True}
        while not stop.is_set():
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            if response.status_code != 200:
                errors.append(response.text)

    clients = [threading.Thread(target=keep_busy) for _ in range(3)]
    for t in clients:
        t.start()
    try:
        scaled_up = _wait_for(lambda: running_replicas(APP) == 2, timeout_s=120)
    finally:
        stop.set()
        for t in clients:
            t.join()
    assert scaled_up, "LLMServer did not reach 2 running replicas under load"
    assert errors == []
    assert _wait_for(lambda: running_replicas(APP) == 1, timeout_s=60), "no scale-down when idle"
