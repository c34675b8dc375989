"""The rolling model switch under Serve: one app of two LLMServer replicas (a small random
Llama), a steady load of completions (whole and streamed) while an admin switches the
model; every request succeeds (the drain bound is long), both replicas switch one after
the other, /v1/models reports the new checkpoint, and the admin routes refuse a user's key
and no key."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import pytest

from tests.support.random_checkpoints import PROMPTS, random_llama_weights, write_llama
from tests.support.serve_apps import served_app

APP = "admin"
ADMIN = {"Authorization": "Bearer admin-key"}
USER = {"Authorization": "Bearer user-key"}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-admin")
    weights = random_llama_weights()
    checkpoints = {
        "a": write_llama(root / "a", weights),
        "b": write_llama(root / "b", {k: v * 1.5 if "down_proj" in k else v for k, v in weights.items()}),
    }  # fmt: skip
    args = {
        "model": checkpoints["a"],
        "served_model_name": "m",
        "min_replicas": 2,
        "max_replicas": 2,
        "num_cpus": 0.125,
        "ingress_max_replicas": 1,
        "max_model_len": 128,
        "max_num_seqs": 8,
        "cpu_kv_cache_gib": 0.01,
        "api_keys": {"user-key": "team"},
        "admin_api_keys": ["admin-key"],
        "switch_drain_timeout_s": 60,
    }
    with served_app(APP, args) as url:
        yield url, checkpoints


def _complete(client: httpx.Client, stream: bool) -> tuple[int, list[int] | None]:
    body = {
        "model": "m",
        "prompt": PROMPTS[0],
        "max_tokens": 16,
        "temperature": 0,
        "stream": stream,
        "return_token_ids": True,
    }
    if not stream:
        response = client.post("/v1/completions", json=body)
        ok = response.status_code == 200
        return response.status_code, response.json()["choices"][0]["token_ids"] if ok else None
    with client.stream("POST", "/v1/completions", json=body) as response:
        text = response.read().decode()
    # A stream that failed after it started carries an error event.
    return (response.status_code if '"error"' not in text else 599), None


def test_a_rolling_switch_under_load_fails_no_request(app):
    url, checkpoints = app
    with httpx.Client(base_url=url, headers=USER, timeout=120) as client:
        for headers, status in ((USER, 403), ({"Authorization": ""}, 401)):
            refused = client.post("/v1/admin/sleep", json={"level": 1}, headers=headers)
            assert refused.status_code == status, refused.text
        status, before = _complete(client, stream=False)
        assert status == 200
        stop, running = threading.Event(), threading.Semaphore(0)

        def load(stream: bool) -> list[int]:
            codes = []
            while not stop.is_set():
                codes.append(_complete(client, stream)[0])
                running.release()
            return codes

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            loads = [pool.submit(load, stream) for stream in (False, True)]
            for _ in range(4):  # the load runs before the switch starts
                assert running.acquire(timeout=60)
            body = {"model": checkpoints["b"], "weights_only": True}
            switched = client.post("/v1/admin/load_model", json=body, headers=ADMIN)
            stop.set()
            codes = [code for done in loads for code in done.result()]
        assert switched.status_code == 200, switched.text
        assert len(set(switched.json()["replicas"])) == 2  # both, one after the other
        assert codes and set(codes) == {200}, codes
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["root"]) for c in cards] == [("m", checkpoints["b"])]
        after = {tuple(_complete(client, stream=False)[1]) for _ in range(4)}
        assert after != {tuple(before)} and len(after) == 1  # every replica runs b
