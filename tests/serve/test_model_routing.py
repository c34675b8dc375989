"""The ingress of several models without Ray: `OpenAIIngress` over fake servers (in-process
hosts behind `LocalServer`, the handle stand-in colocate_ingress uses), driven over ASGI."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

import cluster.ingress
from cluster.app_config import load_app_config
from cluster.local_server import LocalServer
from engine.api.errors import APIError
from engine.api.responses import UsageInfo
from tests.support.outside_serve import build_ingress


class _FakeHost:
    """What the ingress calls on an LLMServer; answers name the model that answered."""

    def __init__(
        self, name: str, max_model_len: int, healthy: bool = True, aliases: tuple = ()
    ) -> None:
        self.name = name
        self.names = (name, *aliases)
        self.max_model_len = max_model_len
        self.healthy = healthy
        self.asked: list[str | None] = []

    async def generate(self, kind: str, request: Any, ctx: Any):
        self.asked.append(request.model)
        if request.model not in (None, *self.names):
            yield APIError(f"The model `{request.model}` does not exist", 404)
            return
        if getattr(request, "stream", False):
            yield 1  # the prompt tokens: the stream has started
            yield f"data: {json.dumps({'model': self.name})}\n\n"
            yield "data: [DONE]\n\n"
            yield UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2)
            return
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        yield {"model": self.name, "kind": kind, "usage": usage}

    def models(self) -> dict:
        cards = [
            {"id": name, "object": "model", "max_model_len": self.max_model_len}
            for name in self.names
        ]
        return {"object": "list", "data": cards}

    async def tokenize(self, request: Any) -> dict:
        self.asked.append(request.model)
        return {"count": 1, "max_model_len": self.max_model_len, "tokens": [1]}

    def detokenize(self, request: Any) -> dict:
        self.asked.append(request.model)
        return {"prompt": self.name}

    def is_healthy(self) -> bool:
        return self.healthy

    async def stats(self) -> dict:
        return {"model": self.name}


pytestmark = pytest.mark.usefixtures("outside_serve")


CHAT = [{"role": "user", "content": "x"}]
SMALL = {"served_model_name": "small", "max_model_len": 256}
TWO = {"models": [SMALL, {"model": "/m/Big"}]}


async def _ingress(args: dict, server: LocalServer | dict[str, LocalServer]) -> Any:
    """The ingress of `args` over `server` (one, or one per model), built outside Serve."""
    return await build_ingress(server, load_app_config(args))


def _serve(args: dict, hosts: dict[str, _FakeHost], requests: list[tuple], single=False):
    """Build the ingress over `hosts` and send `requests` ((method, path, json body));
    returns the responses and the ingress."""

    async def go():
        servers = {name: LocalServer(host, 8) for name, host in hosts.items()}
        only = next(iter(servers.values()))
        ingress = await _ingress(args, only if single else servers)
        transport = httpx.ASGITransport(app=ingress.__serve_build_asgi_app__())
        async with httpx.AsyncClient(transport=transport, base_url="http://kvray") as client:
            responses = [await client.request(m, p, json=body) for m, p, body in requests]
        return responses, ingress

    return asyncio.run(go())


def _hosts() -> dict[str, _FakeHost]:
    return {"small": _FakeHost("small", 256), "Big": _FakeHost("Big", 2048)}


def test_each_route_reaches_the_named_models_server():
    hosts = _hosts()
    requests = [
        ("POST", "/v1/completions", {"model": "Big", "prompt": "hi"}),
        ("POST", "/v1/chat/completions", {"model": "small", "messages": CHAT}),
        ("POST", "/v1/completions", {"model": "small", "prompt": "hi", "stream": True}),
        ("POST", "/tokenize", {"model": "small", "prompt": "hi"}),
        ("POST", "/detokenize", {"model": "Big", "tokens": [1]}),
    ]  # fmt: skip
    (big, chat, stream, tokens, text), _ = _serve(TWO, hosts, requests)
    assert (big.status_code, big.json()["model"]) == (200, "Big")
    assert chat.json()["model"] == "small" and chat.json()["kind"] == "chat"
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert '"model": "small"' in stream.text and stream.text.endswith("data: [DONE]\n\n")
    assert tokens.json()["max_model_len"] == 256
    assert text.json() == {"prompt": "Big"}
    assert hosts["small"].asked == ["small", "small", "small"]
    assert hosts["Big"].asked == ["Big", "Big"]


def test_models_lists_every_served_name_in_config_order():
    (listed,), _ = _serve(TWO, _hosts(), [("GET", "/v1/models", None)])
    assert [(m["id"], m["max_model_len"]) for m in listed.json()["data"]] == [
        ("small", 256),
        ("Big", 2048),
    ]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": "nope", "messages": CHAT}),
        ("/tokenize", {"model": "nope", "prompt": "hi"}),
    ],
)
def test_an_unknown_model_is_openais_404_naming_it_and_what_is_served(path, body):
    hosts = _hosts()
    (response,), _ = _serve(TWO, hosts, [("POST", path, body)])
    assert response.status_code == 404
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"], error["type"]) == (
        "model_not_found",
        "model",
        "NotFoundError",
    )
    assert "`nope`" in error["message"] and "`small`, `Big`" in error["message"]
    assert hosts["small"].asked == hosts["Big"].asked == []


def test_without_a_model_several_models_are_a_400_naming_them():
    hosts = _hosts()
    requests = [
        ("POST", "/v1/completions", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [1]}),
    ]
    responses, _ = _serve(TWO, hosts, requests)
    for response in responses:
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "model" and "`small`, `Big`" in error["message"]
    assert hosts["small"].asked == hosts["Big"].asked == []


class _Counted:
    """The ingress's metrics sink, keeping its counters' labels."""

    incs: list[tuple[str, dict]] = []

    def inc(self, name: str, value: float, labels: dict) -> None:
        self.incs.append((name, dict(labels)))


def test_one_model_answers_requests_naming_none_and_refuses_unknown_names_itself(monkeypatch):
    monkeypatch.setattr(cluster.ingress, "RayMetricsSink", _Counted)
    _Counted.incs = []
    host = _FakeHost("SmolLM2-135M-Instruct", 512)
    requests = [
        ("POST", "/v1/completions", {"prompt": "hi"}),
        ("POST", "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "hi"}),
        ("POST", "/v1/completions", {"model": "other", "prompt": "hi"}),
        ("POST", "/tokenize", {"model": "other", "prompt": "hi"}),
        ("GET", "/v1/models", None),
    ]
    (plain, named, other, tokens, listed), ingress = _serve(
        {}, {host.name: host}, requests, single=True
    )
    assert plain.status_code == named.status_code == 200
    for refused in (other, tokens):
        assert refused.status_code == 404
        error = refused.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert (
            "`other` does not exist (this server serves `SmolLM2-135M-Instruct`)"
            in (error["message"])
        )
    assert host.asked == [None, "SmolLM2-135M-Instruct"]  # never asked about `other`
    # A client's unknown name never becomes a label value.
    done = [labels for name, labels in _Counted.incs if name == "kvray_http_requests"]
    assert [(d["model"], d["code"]) for d in done] == [
        ("SmolLM2-135M-Instruct", "200"),
        ("SmolLM2-135M-Instruct", "200"),
        ("", "404"),
    ]
    assert [m["id"] for m in listed.json()["data"]] == [host.name]
    assert ingress.router.names == ["SmolLM2-135M-Instruct"]


def test_a_model_s_aliases_reach_its_server_and_are_listed():
    config = {
        "models": [
            {"served_model_name": ["small", "tiny"], "max_model_len": 256},
            {"model": "/m/Big"},
        ]
    }
    hosts = {"small": _FakeHost("small", 256, aliases=("tiny",)), "Big": _FakeHost("Big", 2048)}
    requests = [
        ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi"}),
        ("POST", "/v1/completions", {"model": "nope", "prompt": "hi"}),
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/tiny", None),
    ]
    (aliased, unknown, listed, card), ingress = _serve(config, hosts, requests)
    assert aliased.status_code == 200 and hosts["small"].asked == ["tiny"]
    assert "`small`, `tiny`, `Big`" in unknown.json()["error"]["message"]
    assert [m["id"] for m in listed.json()["data"]] == ["small", "tiny", "Big"]
    assert card.json()["id"] == "tiny"
    assert ingress.router.names == ["small", "Big"]


def test_health_needs_every_models_servers():
    (ok,), _ = _serve(TWO, _hosts(), [("GET", "/health", None)])
    assert ok.status_code == 200
    hosts = _hosts()
    hosts["Big"].healthy = False
    (sick,), _ = _serve(TWO, hosts, [("GET", "/health", None)])
    assert sick.status_code == 503


def test_stats_name_the_model_when_several_are_served():
    async def ask(ingress):
        return await ingress.stats("Big"), await ingress.stats("small")

    _, ingress = _serve(TWO, _hosts(), [])
    assert asyncio.run(ask(ingress)) == ({"model": "Big"}, {"model": "small"})


@pytest.mark.parametrize(
    "header, seen",
    [("trace-7", "trace-7"), (None, None), ("two words", None), ("x" * 129, None)],
)
def test_a_client_s_x_request_id_reaches_the_server(header, seen):
    """vLLM's habit: the response ids carry the client's X-Request-Id (when it is a plain
    token); the server makes them of the request context's id."""
    host = _FakeHost("small", 256)
    contexts = []
    generate = host.generate

    async def recording(kind, request, ctx):
        contexts.append(ctx)
        async for item in generate(kind, request, ctx):
            yield item

    host.generate = recording

    async def go() -> int:
        ingress = await _ingress(SMALL, LocalServer(host, 8))
        transport = httpx.ASGITransport(app=ingress.__serve_build_asgi_app__())
        headers = {} if header is None else {"X-Request-Id": header}
        async with httpx.AsyncClient(transport=transport, base_url="http://kvray") as client:
            body = {"model": "small", "prompt": "x"}
            response = await client.post("/v1/completions", json=body, headers=headers)
        return response.status_code

    assert asyncio.run(go()) == 200
    assert [ctx.request_id for ctx in contexts] == [seen]


@pytest.mark.parametrize("length", ["²", "1e9", "-5"])
def test_a_content_length_that_is_no_plain_number_is_not_a_500(length):
    """Only ASCII digits count as a declared body size; the body itself is still bounded."""
    host = _FakeHost("small", 256)

    async def go() -> int:
        ingress = await _ingress(SMALL, LocalServer(host, 8))
        body = json.dumps({"model": "small", "prompt": "x"}).encode()
        scope = {
            "type": "http", "method": "POST", "path": "/v1/completions", "root_path": "",
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", length.encode("latin-1"))],
            "query_string": b"", "http_version": "1.1", "scheme": "http",
        }  # fmt: skip
        sent = []

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        await ingress.__serve_build_asgi_app__()(scope, receive, send)
        return sent[0]["status"]

    assert asyncio.run(go()) == 200


@pytest.mark.parametrize(
    "prompt, accepted",
    [(["a"] * 3, True), (["a"] * 4, False), ([[1]] * 4, False), ([1] * 4, True)],
)
def test_a_completion_of_more_prompts_than_max_completion_prompts_is_a_400(prompt, accepted):
    """Each prompt of a list is an engine request of its own: the list is bounded before any
    reaches the engine (a list of token ids is one prompt)."""
    host = _FakeHost("small", 256)
    args = {**SMALL, "max_completion_prompts": 3}
    body = {"model": "small", "prompt": prompt}
    (response,), _ = _serve(args, {"small": host}, [("POST", "/v1/completions", body)])
    if accepted:
        assert response.status_code == 200
        assert host.asked == ["small"]
    else:
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "prompt"
        assert "4 prompts" in error["message"] and "at most 3" in error["message"]
        assert host.asked == []


def test_max_completion_prompts_defaults_to_vllms_1024():
    assert load_app_config(SMALL).max_completion_prompts == 1024


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_client_gone_while_its_body_is_read_is_counted_as_gone_not_an_error(monkeypatch, path):
    monkeypatch.setattr(cluster.ingress, "RayMetricsSink", _Counted)
    _Counted.incs = []
    host = _FakeHost("small", 256)

    async def go() -> list[dict]:
        ingress = await _ingress({}, LocalServer(host, 8))
        app = ingress.__serve_build_asgi_app__()
        scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "query_string": b""}  # fmt: skip
        sent = []

        async def receive() -> dict:
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        await app(scope, receive, send)  # ClientDisconnect escaped here: Serve logged a 500
        return sent

    sent = asyncio.run(go())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert host.asked == []
    done = [labels["code"] for name, labels in _Counted.incs if name == "kvray_http_requests"]
    assert done == (["499"] if path != "/tokenize" else [])
