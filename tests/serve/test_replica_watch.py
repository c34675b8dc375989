"""The ingress while no replica answers, without Ray: /health answers 503 within a second
and leaves no stray future behind, and requests wait at most `no_replica_wait_s` for a
replica, then get 503 with Retry-After. The server stands in for an LLMServer handle
whose replicas are all gone: Serve's handle holds every call until one is back."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import httpx
import pytest

from cluster.app_config import load_app_config
from cluster.replica_watch import ReplicaWatch
from tests.support.outside_serve import build_ingress

pytestmark = pytest.mark.usefixtures("outside_serve")

CHAT = [{"role": "user", "content": "x"}]


class _Call:
    """A handle call that is answered once its replica is back (`back` is set)."""

    def __init__(self, back: asyncio.Event, answer: Any) -> None:
        self.back = back
        self.answer = answer
        self.cancelled = False

    def __await__(self):
        return self._result().__await__()

    async def _result(self) -> Any:
        await self.back.wait()
        return self.answer

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> Any:
        if self.answer is None:
            raise StopAsyncIteration
        answer, self.answer = self.answer, None
        return await _Call(self.back, answer)

    def cancel(self) -> None:
        self.cancelled = True


class _Method:
    def __init__(self, handle: _Handle, answer: Any) -> None:
        self.handle, self.answer = handle, answer

    def remote(self, *args: Any) -> _Call:
        call = _Call(self.handle.back, self.answer)
        self.handle.calls.append(call)
        return call


class _Handle:
    """An LLMServer handle with no replica until `back` is set."""

    def __init__(self) -> None:
        self.back = asyncio.Event()
        self.calls: list[_Call] = []
        self.is_healthy = _Method(self, True)
        self.generate = _Method(self, {"id": "cmpl-1", "usage": {}})

    def options(self, **_: Any) -> _Handle:
        return self


def _run(test, args: dict | None = None) -> Any:
    """Run `test(client, handle)` against an ingress over a replica-less handle; returns
    what it returns and the loop's unhandled-exception messages."""
    unhandled: list[str] = []

    async def go() -> Any:
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: unhandled.append(context["message"])
        )
        handle = _Handle()
        ingress = await build_ingress(handle, load_app_config(args or {}))
        transport = httpx.ASGITransport(app=ingress.__serve_build_asgi_app__())
        async with httpx.AsyncClient(transport=transport, base_url="http://kvray") as client:
            result = await test(client, handle)
        gc.collect()
        await asyncio.sleep(0)
        return result

    return asyncio.run(go()), unhandled


def _timed(coro) -> Any:
    async def timed() -> tuple[float, Any]:
        start = time.monotonic()
        result = await coro
        return time.monotonic() - start, result

    return timed()


def test_health_answers_503_within_a_second_while_no_replica_answers():
    async def test(client, handle):
        first = await _timed(client.get("/health"))
        again = await _timed(client.get("/health"))
        return first, again, handle

    ((first_s, first), (again_s, again), handle), unhandled = _run(test)
    assert first.status_code == 503 and first_s < 1.5
    assert first.json()["error"]["type"] == "ServiceUnavailableError"
    assert first.headers["retry-after"] == "1"
    # Known to be down: the second answer needs no probe of its own.
    assert again.status_code == 503 and again_s < 0.2
    # Every probe no replica took is cancelled: Serve's handle would keep it queued.
    assert all(call.cancelled for call in handle.calls)
    assert unhandled == []


def test_a_health_check_whose_client_leaves_leaves_no_stray_future():
    async def test(client, handle):
        # Serve cancels the request's task when its client goes away.
        check = asyncio.create_task(client.get("/health"))
        await asyncio.sleep(0.2)
        check.cancel()
        with pytest.raises(asyncio.CancelledError):
            await check
        await asyncio.sleep(0.1)

    _, unhandled = _run(test)
    assert unhandled == []


def test_requests_wait_for_a_replica_at_most_the_bound_then_get_503():
    async def test(client, handle):
        await client.get("/health")  # finds no replica
        return await _timed(client.post("/v1/completions", json={"prompt": "hi"}))

    (waited_s, r), unhandled = _run(test, {"no_replica_wait_s": 0.5})
    assert r.status_code == 503 and 0.4 < waited_s < 1.5
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "no_replica"
    assert unhandled == []


def test_a_request_waiting_when_the_replicas_are_lost_gets_the_same_bound():
    """A request sent while its replica was believed up waits in Serve's handle; once a
    probe finds none, it has `no_replica_wait_s` left."""

    async def test(client, handle):
        sent = asyncio.create_task(_timed(client.post("/v1/completions", json={"prompt": "a"})))
        await asyncio.sleep(0.1)
        await client.get("/health")  # no replica answers: the loss is known from here
        return await sent

    (waited_s, r), _ = _run(test, {"no_replica_wait_s": 0.5})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
    assert waited_s < 2


def test_a_replica_back_within_the_bound_serves_the_waiting_requests():
    async def test(client, handle):
        assert (await client.get("/health")).status_code == 503
        waiting = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a"}))
        await asyncio.sleep(0.2)
        handle.back.set()  # the next probe finds the new replica
        r = await waiting
        health = await client.get("/health")
        return r, health

    (r, health), _ = _run(test, {"no_replica_wait_s": 5})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-1"
    assert health.status_code == 200 and health.json()["status"] == "healthy"


def test_a_model_that_scales_to_zero_waits_for_its_first_replica():
    async def test(client, handle):
        await client.get("/health")
        waiting = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a"}))
        await asyncio.sleep(1.0)
        handle.back.set()
        return await waiting

    r, _ = _run(test, {"no_replica_wait_s": 0.3, "min_replicas": 0})
    assert r.status_code == 200


def test_a_request_past_its_own_time_limit_gets_408_while_its_replica_is_up():
    async def test(client, handle):
        return await client.post("/v1/completions", json={"prompt": "a"})

    r, _ = _run(test, {"request_timeout_s": 0.3, "no_replica_wait_s": 5})
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"


def test_a_probe_a_busy_replica_is_slow_to_take_is_no_loss_once_it_has_answered_meanwhile():
    """A replica that streams on a loaded box may take a probe late: its stream's replies
    say it is up, so the probe's timeout must not cut the requests waiting on it."""

    async def test():
        handle = _Handle()
        watch = ReplicaWatch("m", handle, no_replica_wait_s=5)
        probing = asyncio.create_task(watch.probe(timeout_s=0.2))
        await asyncio.sleep(0.05)
        watch.saw_reply()  # a stream's chunk arrives while the probe waits
        healthy = await probing
        up_after_stale_probe = watch.up
        # With no reply meanwhile, a probe no replica takes is a loss.
        return healthy, up_after_stale_probe, await watch.probe(timeout_s=0.2), watch.up

    healthy, up_after_stale_probe, healthy_again, up_at_end = asyncio.run(test())
    assert not healthy and up_after_stale_probe
    assert not healthy_again and not up_at_end
