"""kvray's gRPC API through Ray Serve's gRPC proxy: the same answers, errors, tenants and
limits as HTTP, on one app (bundled SmolLM2 on CPU) that serves both."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.grpc_api import inference_pb2 as pb
from cluster.grpc_api import inference_pb2_grpc as pb_grpc
from tests.support.serve_apps import grpc_port, served_app, server_stats, wait_until_idle

APP = "grpc"
MODEL = "SmolLM2-135M-Instruct"
ARGS = {
    "max_model_len": 512,
    "max_num_seqs": 8,
    "max_ongoing_requests": 8,
    "num_cpus": 0.25,
    "ingress_max_replicas": 1,
    "api_keys": {"key-alice": "alice", "key-capped": "capped", "key-hasty": "hasty"},
    "tenants": {
        "capped": {"max_concurrent_requests": 1},
        "hasty": {"request_timeout_s": 1.5},
    },
}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
LONG = {"max_tokens": 400, "ignore_eos": True}


def _key(name: str = "key-alice") -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {name}")]


@pytest.fixture(scope="module")
def url():
    with served_app(APP, ARGS, grpc=True) as url:
        yield url


@pytest.fixture(scope="module")
def channel(url):
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port()}") as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.InferenceServiceStub(channel)


def _http(url: str, path: str, body: dict, key: str = "key-alice") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def _grpc_request(body: dict) -> pb.GenerateRequest:
    fields = {k: v for k, v in body.items() if k not in ("prompt", "messages")}
    if "messages" in body:
        messages = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in body["messages"]])
        return pb.GenerateRequest(messages=messages, **fields)
    return pb.GenerateRequest(prompt=body["prompt"], **fields)


def _http_choice(choice: dict) -> tuple[str, list[int], str]:
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["token_ids"], choice["finish_reason"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
        {"messages": CHAT, "max_tokens": 12, "temperature": 0.8, "seed": 7, "logprobs": 2},
    ],
    ids=["greedy-completion", "seeded-chat"],
)
def test_unary_and_stream_answer_as_http_does(url, stub, body):
    http_body = {**body, "return_token_ids": True}
    if "messages" in body and "logprobs" in body:
        http_body.update(logprobs=True, top_logprobs=body["logprobs"])
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    expected = _http(url, path, http_body).json()
    text, ids, finish = _http_choice(expected["choices"][0])

    whole = stub.Generate(_grpc_request(body), metadata=_key())
    (choice,) = whole.choices
    assert (choice.text, list(choice.token_ids), choice.finish_reason) == (text, ids, finish)
    assert whole.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert whole.usage.completion_tokens == expected["usage"]["completion_tokens"] == len(ids)
    # A chat's prompt ids are the response's, a completion's its choice's.
    prompt_ids = expected.get("prompt_token_ids") or expected["choices"][0]["prompt_token_ids"]
    assert list(whole.prompt_token_ids) == prompt_ids
    if "logprobs" in body:
        http_logprobs = expected["choices"][0]["logprobs"]["content"]
        assert [lp.token for lp in choice.logprobs] == [e["token"] for e in http_logprobs]
        assert [len(lp.top_logprobs) for lp in choice.logprobs] == [2] * len(ids)

    messages = list(stub.GenerateStream(_grpc_request(body), metadata=_key()))
    assert "".join(c.text for m in messages for c in m.choices) == text
    assert [i for m in messages for c in m.choices for i in c.token_ids] == ids
    assert [c.finish_reason for m in messages for c in m.choices if c.finish_reason] == [finish]
    assert list(messages[0].prompt_token_ids) == list(whole.prompt_token_ids)
    assert messages[-1].usage == whole.usage and not messages[0].HasField("usage")


@pytest.mark.parametrize(
    "body, key, status, code",
    [
        ({"prompt": PROMPT, "n": 0}, "key-alice", 400, grpc.StatusCode.INVALID_ARGUMENT),
        ({"model": "nope", "prompt": PROMPT}, "key-alice", 404, grpc.StatusCode.NOT_FOUND),
        ({"prompt": PROMPT}, "wrong", 401, grpc.StatusCode.UNAUTHENTICATED),
    ],
    ids=["bad-field", "unknown-model", "bad-key"],
)
def test_errors_carry_the_http_message_under_the_mapped_code(url, stub, body, key, status, code):
    http = _http(url, "/v1/completions", body, key=key)
    assert http.status_code == status
    message = http.json()["error"]["message"]
    for call in (stub.Generate, lambda *a, **k: list(stub.GenerateStream(*a, **k))):
        with pytest.raises(grpc.RpcError) as error:
            call(_grpc_request(body), metadata=_key(key))
        assert (error.value.code(), error.value.details()) == (code, message)


def test_a_tenant_s_limit_counts_http_and_grpc_requests_together(url, stub):
    long = _grpc_request({"prompt": PROMPT, **LONG})
    held = stub.GenerateStream(long, metadata=_key("key-capped"))
    next(held)  # the tenant's one slot is taken, over gRPC
    http = _http(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, key="key-capped")
    assert http.status_code == 429
    with pytest.raises(grpc.RpcError) as error:
        stub.Generate(_grpc_request({"prompt": PROMPT}), metadata=_key("key-capped"))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.value.details() == http.json()["error"]["message"]
    trailing = dict(error.value.trailing_metadata())
    assert trailing["retry-after"] == http.headers["retry-after"]
    held.cancel()
    wait_until_idle(APP, timeout_s=2)


def test_a_cancelled_stream_frees_its_kv_within_2_s(stub):
    stream = stub.GenerateStream(_grpc_request({"prompt": PROMPT, **LONG}), metadata=_key())
    for _ in range(4):
        next(stream)
    assert server_stats(APP)["num_running"] == 1
    stream.cancel()
    elapsed, stats = wait_until_idle(APP, timeout_s=2)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, stats
    assert elapsed < 2


def test_the_request_time_limit_is_a_deadline_exceeded_that_frees_kv(url, stub):
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as error:
        stub.Generate(_grpc_request({"prompt": PROMPT, **LONG}), metadata=_key("key-hasty"))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "request_timeout_s" in error.value.details()
    assert time.monotonic() - start < 5
    _, stats = wait_until_idle(APP, timeout_s=2)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, stats


def test_tokenize_models_health_and_reflection(url, stub, channel):
    http = _http(url, "/tokenize", {"messages": CHAT}).json()
    messages = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
    tokens = stub.Tokenize(pb.TokenizeRequest(messages=messages), metadata=_key())
    assert (list(tokens.tokens), tokens.count) == (http["tokens"], http["count"])
    models = stub.Models(pb.ModelsRequest(), metadata=_key())
    assert [(m.id, m.max_model_len) for m in models.models] == [(MODEL, 512)]
    with pytest.raises(grpc.RpcError) as error:
        stub.Models(pb.ModelsRequest())
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    health = stub.Health(pb.HealthRequest())
    assert (health.status, list(health.models)) == ("healthy", [MODEL])
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    (answer,) = reflection.ServerReflectionInfo(iter([ask]))
    names = [s.name for s in answer.list_services_response.service]
    assert "kvray.v1.InferenceService" in names
