"""The admin API of the model lifecycle without Ray: the ingress built outside Serve over one
real engine host (a small random Llama, behind `LocalServer`), driven over ASGI; and the
replica's drain with a stand-in engine (cluster/admin_api.py, cluster/replica_lifecycle.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import cluster.engine_host
from cluster.app_config import load_app_config
from cluster.local_server import LocalServer
from cluster.replica_lifecycle import ReplicaLifecycle
from tests.support.outside_serve import build_ingress
from tests.support.random_checkpoints import PROMPTS, random_llama_weights, write_llama

pytestmark = pytest.mark.usefixtures("outside_serve")

ADMIN = {"Authorization": "Bearer admin-key"}
USER = {"Authorization": "Bearer user-key"}
SMALL = dict(max_model_len=128, cpu_kv_cache_gib=0.01, max_num_seqs=4, served_model_name="m")


class RecordingSink:
    """The metrics sink of a replica outside Ray: the last value of each gauge, counters."""

    def __init__(self) -> None:
        self.gauges: dict[tuple, float] = {}
        self.counters: dict[tuple, float] = {}

    def set(self, name: str, value: float, labels: dict) -> None:
        self.gauges[(name, *sorted(labels.items()))] = value

    def inc(self, name: str, value: float, labels: dict) -> None:
        key = (name, *sorted(labels.items()))
        self.counters[key] = self.counters.get(key, 0) + value

    def observe(self, *args: Any) -> None:
        pass

    def state(self) -> str:
        on = [
            dict(k[1:])["state"]
            for k, v in self.gauges.items()
            if k[0] == "kvray_model_state" and v
        ]
        assert len(on) == 1, on
        return on[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("admin")
    weights = random_llama_weights()
    other = {k: v * 1.5 if "down_proj" in k else v for k, v in weights.items()}
    up = "model.layers.1.mlp.up_proj.weight"
    shapes = write_llama(root / "shapes", weights)
    save_file({**weights, up: torch.zeros(500, 256)}, Path(shapes) / "model.safetensors")
    return {
        "a": write_llama(root / "a", weights),
        "b": write_llama(root / "b", other),
        "shapes": shapes,
        "missing": str(root / "nowhere"),
    }


def _serve(checkpoints, args: dict, steps):
    """An ingress over a real host of checkpoint a; `steps(client, host)` drives it."""
    sink = RecordingSink()

    async def go():
        config = load_app_config({"model": checkpoints["a"], **SMALL, **args})
        host = cluster.engine_host.EngineHost()
        await host.start(config)
        try:
            ingress = await build_ingress(LocalServer(host, 8), config)
            transport = httpx.ASGITransport(app=ingress.__serve_build_asgi_app__())
            async with httpx.AsyncClient(transport=transport, base_url="http://kvray") as client:
                return await steps(client, host)
        finally:
            host.shutdown()

    original = cluster.engine_host.RayMetricsSink
    cluster.engine_host.RayMetricsSink = lambda: sink
    try:
        return asyncio.run(go())
    finally:
        cluster.engine_host.RayMetricsSink = original


async def _complete(client) -> httpx.Response:
    body = {
        "model": "m",
        "prompt": PROMPTS[0],
        "max_tokens": 4,
        "temperature": 0,
        "return_token_ids": True,  # the random model has no tokenizer: no text
    }
    return await client.post("/v1/completions", json=body)


def _tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_admin_routes_are_off_without_admin_keys(checkpoints):
    async def steps(client, host):
        for method, path in (("POST", "sleep"), ("GET", "sleep"), ("GET", "is_sleeping")):
            response = await client.request(method, f"/v1/admin/{path}", headers=ADMIN)
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "not_found"

    _serve(checkpoints, {}, steps)


# In an engine process (the default on one GPU) the host reads the switched model's name,
# tokenizer and limits again over the pipe (AsyncEngine.refresh_model_info).
@pytest.mark.parametrize("engine_process", [False, True])
def test_keys_switch_sleep_and_wake(checkpoints, engine_process):
    keys = {
        "admin_api_keys": ["admin-key"],
        "api_keys": {"user-key": "team"},
        "engine_process": engine_process,
    }

    async def steps(client, host):
        sink = host.lifecycle.sink
        # Refused: a user's key (403), no key (401); in OpenAI's error shape.
        for headers, status in ((USER, 403), ({}, 401), ({"Authorization": "Bearer x"}, 401)):
            response = await client.post("/v1/admin/wake_up", headers=headers)
            assert response.status_code == status
            assert response.json()["error"]["type"] in (
                "PermissionDeniedError",
                "AuthenticationError",
            )
        client.headers.update(USER)
        before = await _complete(client)
        assert sink.state() == "serving"

        # A checkpoint of other shapes: refused naming the tensor; the old model serves on.
        body = {"model": checkpoints["shapes"], "weights_only": True}
        response = await client.post("/v1/admin/load_model", json=body, headers=ADMIN)
        assert response.status_code == 400
        assert "model.layers.1.mlp.up_proj.weight" in response.json()["error"]["message"]
        missing = {"model": checkpoints["missing"], "weights_only": True}
        response = await client.post("/v1/admin/load_model", json=missing, headers=ADMIN)
        assert response.status_code == 400 and "nowhere" in response.json()["error"]["message"]
        assert _tokens(await _complete(client)) == _tokens(before)
        bad = await client.post("/v1/admin/sleep", json={"level": 3}, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"

        # Weights in place, then a whole switch back: the served name stays, the root follows.
        for model, weights_only in ((checkpoints["b"], True), (checkpoints["a"], False)):
            body = {"model": model, "weights_only": weights_only}
            response = await client.post("/v1/admin/load_model", json=body, headers=ADMIN)
            assert response.status_code == 200, response.text
            cards = (await client.get("/v1/models")).json()["data"]
            assert [(c["id"], c["root"]) for c in cards] == [("m", model)]
            switched = _tokens(await _complete(client))
            assert (switched == _tokens(before)) == (model == checkpoints["a"])
        assert sink.gauges[("kvray_model_switches", ("model", "m"), ("outcome", "done"))] == 2
        assert sink.gauges[("kvray_model_switches", ("model", "m"), ("outcome", "failed"))] == 2

        # Asleep: generation is a 503 naming the wake-up; awake again, the same tokens.
        response = await client.post("/v1/admin/sleep", json={"level": 1}, headers=ADMIN)
        assert response.status_code == 200, response.text
        assert sink.state() == "asleep"
        status = await client.get("/v1/admin/is_sleeping", headers=ADMIN)
        assert status.json()["is_sleeping"] is True
        refused = await _complete(client)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "model_asleep"
        assert "/v1/admin/wake_up" in refused.json()["error"]["message"]
        assert (await client.post("/v1/admin/wake_up", headers=ADMIN)).status_code == 200
        assert sink.state() == "serving"
        assert _tokens(await _complete(client)) == _tokens(before)
        reset = await client.post("/v1/admin/reset_prefix_cache", headers=ADMIN)
        assert reset.status_code == 200 and reset.json()["models"]["m"][0]["reset"] is True

    _serve(checkpoints, keys, steps)


def test_wake_on_request_wakes_a_sleeping_model(checkpoints):
    args = {"admin_api_keys": ["admin-key"], "wake_on_request": True}

    async def steps(client, host):
        before = _tokens(await _complete(client))
        assert (await client.post("/v1/admin/sleep", json={"level": 2}, headers=ADMIN)).is_success
        assert _tokens(await _complete(client)) == before
        status = await client.get("/v1/admin/is_sleeping", headers=ADMIN)
        assert status.json()["is_sleeping"] is False

    _serve(checkpoints, args, steps)


def test_a_request_past_the_drain_bound_ends_with_a_clear_error(checkpoints):
    args = {"admin_api_keys": ["admin-key"], "switch_drain_timeout_s": 0}

    async def steps(client, host):
        long = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 110, "ignore_eos": True}
        whole = asyncio.create_task(client.post("/v1/completions", json=long))
        streamed = asyncio.create_task(
            client.post("/v1/completions", json={**long, "stream": True})
        )
        while len(host.lifecycle._running) < 2:  # both run: the switch aborts them at once
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)  # a few tokens in: the stream has begun (mostly)
        body = {"model": checkpoints["b"], "weights_only": True}
        switched = await client.post("/v1/admin/load_model", json=body, headers=ADMIN)
        assert switched.status_code == 200, switched.text
        whole, streamed = await whole, await streamed
        assert whole.status_code == 503 and whole.json()["error"]["code"] == "model_switching"
        if streamed.status_code == 200:  # begun: an SSE error event ends it
            assert '"code": "model_switching"' in streamed.text.replace('":"', '": "')
            assert streamed.text.endswith("data: [DONE]\n\n")
        else:  # aborted before its first event
            assert streamed.status_code == 503
            assert streamed.json()["error"]["code"] == "model_switching"
        assert _tokens(await _complete(client))  # the new model serves

    _serve(checkpoints, args, steps)


class _Engine:
    """Stands in for the engine under a ReplicaLifecycle: records its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def call(self, method: str, *args: Any) -> Any:
        self.calls.append(method)

    async def load(self, model: str, weights_only: bool) -> None:
        self.calls.append(f"load {model}")

    async def warm_up(self) -> None:
        self.calls.append("warm_up")


async def _request(lifecycle: ReplicaLifecycle, seconds: float, log: list) -> None:
    """A request as the host runs one: admitted, running `seconds`, answered."""
    refused = await lifecycle.admit()
    assert refused is None
    running = lifecycle.started()
    try:
        await asyncio.sleep(seconds)  # in the engine
        log.append(("done", seconds))
    except asyncio.CancelledError:
        if not lifecycle.took_back(running):
            raise
        log.append(("aborted", seconds))
    finally:
        lifecycle.ended(running)


def test_a_switch_drains_holds_new_requests_and_aborts_past_its_bound():
    async def go():
        engine, log = _Engine(), []
        lifecycle = ReplicaLifecycle(
            "m", engine.call, engine.load, engine.warm_up, drain_timeout_s=0.3
        )
        short = asyncio.create_task(_request(lifecycle, 0.1, log))
        long = asyncio.create_task(_request(lifecycle, 30, log))
        await asyncio.sleep(0)
        switch = asyncio.create_task(lifecycle.load_model("new", True))
        await asyncio.sleep(0.05)
        assert lifecycle.state == "switching"
        late = asyncio.create_task(_request(lifecycle, 0.01, log))  # waits out the switch
        await asyncio.sleep(0.05)
        assert engine.calls == []  # still draining
        assert await switch == {"model": "new", "weights_only": True}
        await asyncio.gather(short, long, late)
        return engine.calls, log, lifecycle.state

    calls, log, state = asyncio.run(go())
    assert calls == ["load new", "warm_up"]
    # The short request finished, the long one was aborted at the bound, the late one ran
    # on the new model.
    assert log == [("done", 0.1), ("aborted", 30), ("done", 0.01)]
    assert state == "serving"


def test_admin_keys_are_checked_and_kept_apart_from_user_keys():
    config = load_app_config({"admin_api_keys": '["a1", "a2"]'})
    assert config.admin_api_keys == ["a1", "a2"]
    assert load_app_config({"admin_api_keys": "solo"}).admin_api_keys == ["solo"]
    with pytest.raises(ValueError, match=r"admin_api_keys\[1\] is also a key of api_keys"):
        load_app_config({"admin_api_keys": ["a", "u"], "api_keys": {"u": "team"}})
    with pytest.raises(ValueError, match=r"admin_api_keys\[0\] is empty"):
        load_app_config({"admin_api_keys": [""]})
    with pytest.raises(ValueError, match="switch_drain_timeout_s"):
        load_app_config({"switch_drain_timeout_s": -1})
    assert json.loads(json.dumps(config.model_dump()))["wake_on_request"] is False


def test_a_request_between_engine_outputs_is_aborted_without_a_cancellation():
    """A cancellation that landed where a stream hands an item to its caller would end it
    without its error: there the request sees `aborted` after the item instead."""

    async def go():
        engine = _Engine()
        lifecycle = ReplicaLifecycle(
            "m", engine.call, engine.load, engine.warm_up, drain_timeout_s=0
        )

        async def stream() -> int:
            running = lifecycle.started()
            items = 0
            try:
                while not running.aborted:
                    running.in_engine = False
                    await asyncio.sleep(0.01)  # the caller takes the item
                    items += 1
            finally:
                lifecycle.ended(running)
            return items

        task = asyncio.create_task(stream())
        await asyncio.sleep(0.03)
        await lifecycle.load_model("new", True)
        return await task, engine.calls  # a cancellation would raise here

    items, calls = asyncio.run(go())
    assert items >= 1 and calls == ["load new", "warm_up"]
