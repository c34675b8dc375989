"""A replica that dies under a request, seen by the ingress without Ray: the server stands
in for an LLMServer handle whose calls raise Ray's actor errors where the replica died.

tests/serve/test_replica_failures.py kills real replicas; here each point of death is
reached on purpose: before a stream's first reply, in the middle of it, under a request
sent whole, under /tokenize.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from cluster.app_config import load_app_config
from engine.api.responses import UsageInfo
from tests.support.outside_serve import build_ingress

pytestmark = pytest.mark.usefixtures("outside_serve")

USAGE = UsageInfo(prompt_tokens=1, completion_tokens=2, total_tokens=3)


class _Replies:
    """A call's replies: `items`, and where one is an exception, raised there."""

    def __init__(self, items: list) -> None:
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self) -> _Replies:
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def __await__(self):
        return self.__anext__().__await__()

    def cancel(self) -> None:
        self.cancelled = True


class _Method:
    def __init__(self, answers: list[list]) -> None:
        self.answers = answers
        self.calls: list[_Replies] = []

    def remote(self, *args: Any) -> _Replies:
        call = _Replies(self.answers.pop(0))
        self.calls.append(call)
        return call


class _Handle:
    """An LLMServer handle whose successive calls get `generate`'s answers in turn."""

    def __init__(self, generate: list[list], tokenize: list[list] | None = None) -> None:
        self.generate = _Method(generate)
        self.tokenize = _Method(tokenize or [])
        self.is_healthy = _Method([[True]] * 10)

    def options(self, **_: Any) -> _Handle:
        return self


def _post(handle: _Handle, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        ingress = await build_ingress(handle, load_app_config({}))
        transport = httpx.ASGITransport(app=ingress.__serve_build_asgi_app__())
        async with httpx.AsyncClient(transport=transport, base_url="http://kvray") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def _events(r: httpx.Response) -> list[str]:
    return [line for line in r.text.split("\n\n") if line]


def test_a_stream_whose_replica_dies_midway_ends_with_an_error_event_then_done():
    handle = _Handle([[3, 'data: {"n": 1}\n\n', ActorDiedError()]])
    r = _post(handle, "/v1/completions", {"prompt": "hi", "stream": True})
    assert r.status_code == 200
    first, error, done = _events(r)
    assert first == 'data: {"n": 1}'
    body = json.loads(error.removeprefix("data: "))["error"]
    assert body["type"] == "ServiceUnavailableError"
    assert body["code"] == "replica_unavailable"
    assert "stopped while it ran this request (ActorDiedError)" in body["message"]
    assert done == "data: [DONE]"


def test_a_stream_whose_replica_dies_before_its_first_reply_is_sent_again():
    served = [3, 'data: {"n": 1}\n\n', "data: [DONE]\n\n", USAGE]
    handle = _Handle([[ActorUnavailableError("gone", None)], served])
    r = _post(handle, "/v1/completions", {"prompt": "hi", "stream": True})
    assert r.status_code == 200
    assert _events(r) == ['data: {"n": 1}', "data: [DONE]"]
    assert len(handle.generate.calls) == 2 and handle.generate.calls[0].cancelled


def test_a_request_sent_whole_whose_replica_dies_gets_503_with_retry_after():
    handle = _Handle([[ActorDiedError()], [{"id": "never"}]])
    r = _post(handle, "/v1/completions", {"prompt": "hi"})
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "replica_unavailable"
    assert len(handle.generate.calls) == 1


def test_a_tokenize_whose_replica_dies_gets_503():
    handle = _Handle([], tokenize=[[ActorDiedError()]])
    r = _post(handle, "/tokenize", {"prompt": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
