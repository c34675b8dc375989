"""A tenant's slot and tokens however its request ends: the ingress over a fake server (an
in-process host behind `LocalServer`) and an in-process `TenantLimiter`, driven over ASGI
as Serve drives it (a client that leaves has its request's task cancelled)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

import cluster.ingress
from cluster.app_config import load_app_config
from cluster.local_server import LocalServer
from engine.api.responses import UsageInfo
from engine.tenants import TenantLimiter
from tests.support.outside_serve import build_ingress

PROMPT_TOKENS = 7
TENANT = {"X-Tenant-Id": "a"}


class _Host:
    """An LLMServer stand-in: `chunks` SSE chunks of one token each, `delay` apart."""

    def __init__(self, chunks: int = 4, delay: float = 0.0, fail: Exception | None = None):
        self.chunks = chunks
        self.delay = delay
        self.fail = fail
        self.running = 0

    async def generate(self, kind: str, request: Any, ctx: Any):
        self.running += 1
        try:
            await asyncio.sleep(self.delay)
            if self.fail is not None:
                raise self.fail
            usage = UsageInfo(
                prompt_tokens=PROMPT_TOKENS,
                completion_tokens=self.chunks,
                total_tokens=PROMPT_TOKENS + self.chunks,
            )
            if not request.stream:
                yield {"choices": [], "usage": usage.model_dump()}
                return
            yield PROMPT_TOKENS
            for i in range(self.chunks):
                yield f"data: {json.dumps({'i': i})}\n\n"
                await asyncio.sleep(self.delay)
            yield "data: [DONE]\n\n"
            yield usage
        finally:
            self.running -= 1

    def is_healthy(self) -> bool:
        return True


class _Method:
    """A handle method's `.remote()` over a local function."""

    def __init__(self, fn: Any):
        self.fn = fn

    def remote(self, *args: Any) -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        done.set_result(self.fn(*args))
        return done


class _LimiterHandle:
    def __init__(self, limiter: TenantLimiter):
        self.acquire = _Method(limiter.acquire)
        self.release = _Method(limiter.release)


pytestmark = pytest.mark.usefixtures("outside_serve")


async def _app(host: _Host, tenant: dict) -> tuple[Any, TenantLimiter, LocalServer]:
    config = load_app_config({"served_model_name": "m", "tenants": {"a": tenant}})
    limiter = TenantLimiter(config.tenants, config.request_timeout_s)
    server = LocalServer(host, 8)
    ingress = await build_ingress(server, config, _LimiterHandle(limiter))
    return ingress.__serve_build_asgi_app__(), limiter, server


def _in_flight(limiter: TenantLimiter) -> int:
    return len(limiter._states["a"].leases)


def _charged(limiter: TenantLimiter) -> int:
    return limiter._states["a"].tokens_in_window


async def _leave(app: Any, body: dict, when: Any = None, after_s: float | None = None) -> None:
    """POST `body` and leave (cancel the request's task, as Serve does on a disconnect)
    once `when(message)` holds for a message the app sends, or after `after_s`."""
    sent_body = json.dumps({"prompt": "x", **body}).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"x-tenant-id", b"a")],
        "query_string": b"",
        "http_version": "1.1",
        "scheme": "http",
        "server": ("kvray", 80),
        "client": ("client", 1),
    }
    leave = asyncio.Event()
    received = False

    async def receive() -> dict:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": sent_body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if when is not None and when(message):
            leave.set()
            await asyncio.sleep(3600)  # the way out is stuck: only the cancel ends it

    task = asyncio.create_task(app(scope, receive, send))
    if after_s is None:
        waiting = asyncio.create_task(leave.wait())
        await asyncio.wait([task, waiting], timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert leave.is_set(), "the app never sent what the client was to leave at"
    else:
        await asyncio.sleep(after_s)
        assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)  # the local server's generator closes in a task of its own


async def _post(app: Any, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvray") as client:
        return await client.post("/v1/completions", json={"prompt": "x", **body}, headers=TENANT)


def test_a_server_failure_gives_the_tenants_slot_back():
    async def go():
        host = _Host(fail=RuntimeError("replica died"))
        app, limiter, _ = await _app(host, {"max_concurrent_requests": 1})
        assert (await _post(app, {})).status_code == 500
        assert _in_flight(limiter) == 0
        host.fail = None
        assert (await _post(app, {})).status_code == 200

    asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_its_first_token_gives_its_slot_back(stream):
    async def go():
        host = _Host(delay=0.2)
        app, limiter, server = await _app(host, {"max_concurrent_requests": 1})
        # It leaves while the server works on it: nothing has been sent yet.
        await _leave(app, {"stream": stream}, after_s=0.05)
        assert (_in_flight(limiter), host.running, server.active) == (0, 0, 0)
        host.delay = 0
        assert (await _post(app, {"stream": stream})).status_code == 200

    asyncio.run(go())


def test_a_client_that_leaves_while_the_headers_go_out_gives_its_slot_back():
    async def go():
        host = _Host(delay=0.01)
        app, limiter, server = await _app(host, {"max_concurrent_requests": 1})
        await _leave(app, {"stream": True}, when=lambda m: m["type"] == "http.response.start")
        # The stream's generator never started: the server's call is aborted all the same.
        assert (_in_flight(limiter), host.running, server.active) == (0, 0, 0)
        assert _charged(limiter) == PROMPT_TOKENS
        assert (await _post(app, {"stream": True})).status_code == 200

    asyncio.run(go())


def test_a_stream_its_client_left_is_charged_its_prompt_and_the_chunks_it_got():
    async def go():
        host = _Host(chunks=50, delay=0.01)
        app, limiter, _ = await _app(host, {"tokens_per_minute": 10_000})
        chunks = 0

        def third_chunk(message: dict) -> bool:
            nonlocal chunks
            chunks += message.get("body", b"").startswith(b"data: {")
            return chunks == 3

        await _leave(app, {"stream": True}, when=third_chunk)
        assert host.running == 0 and _in_flight(limiter) == 0
        assert _charged(limiter) == PROMPT_TOKENS + 3

    asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_ends_is_charged_its_usage(stream):
    async def go():
        app, limiter, _ = await _app(_Host(chunks=4), {"tokens_per_minute": 10_000})
        assert (await _post(app, {"stream": stream})).status_code == 200
        assert _charged(limiter) == PROMPT_TOKENS + 4 and _in_flight(limiter) == 0

    asyncio.run(go())


class _Recording:
    def __init__(self) -> None:
        self.labels: list[dict] = []

    def inc(self, name: str, value: float, labels: dict) -> None:
        self.labels.append(labels)


def test_only_configured_tenants_name_a_metric_series_when_the_header_names_the_tenant(
    monkeypatch,
):
    sink = _Recording()
    monkeypatch.setattr(cluster.ingress, "RayMetricsSink", lambda: sink)

    async def go():
        app, _, _ = await _app(_Host(), {"max_concurrent_requests": 4})
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvray") as client:
            for tenant in ["a", *(f"client-{i}" for i in range(20)), ""]:
                response = await client.post(
                    "/v1/completions", json={"prompt": "x"}, headers={"X-Tenant-Id": tenant}
                )
                assert response.status_code == 200

    asyncio.run(go())
    assert {labels["tenant"] for labels in sink.labels} == {"a", "other", "default"}
