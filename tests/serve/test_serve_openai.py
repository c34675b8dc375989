"""The Serve app end to end: real Ray Serve, real HTTP on 127.0.0.1, the official client,
and kvray's gRPC API through Serve's gRPC proxy (the same answers, errors and limits).

One app (bundled SmolLM2 on CPU) serves the whole module; tenants come from API keys. Its
engine runs in an engine process, as on one GPU (test_cluster_serve covers the engine on a
thread of the replica, as with tensor parallelism).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from pathlib import Path

import grpc
import httpx
import jsonschema
import openai
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.grpc_api import inference_pb2 as pb
from cluster.grpc_api import inference_pb2_grpc as pb_grpc
from engine import LLM, SamplingParams
from engine.tokenizer import apply_chat_template
from tests.support.serve_apps import (
    grpc_port,
    leave_a_stream_midway,
    served_app_beside_offline_llm,
    server_stats,
    wait_until_idle,
)

APP = "openai"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
KEYS = {
    "key-alice": "alice",
    "key-bob": "bob",
    "key-capped": "capped",
    "key-metered": "metered",
    "key-hasty": "hasty",
}
ARGS = {
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 16,
    "max_ongoing_requests": 8,
    "max_queued_requests": 16,
    "num_cpus": 0.25,
    "engine_process": True,
    "ingress_max_replicas": 1,
    "api_keys": KEYS,
    "enable_auto_tool_choice": True,
    "tool_call_parser": "hermes",
    "tenants": {
        "capped": {"max_concurrent_requests": 1},
        "metered": {"tokens_per_minute": 20},
        "hasty": {"request_timeout_s": 1.5},
    },
}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
FAST = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def served():
    """(base URL, offline LLM): the replica and the local LLM load at the same time."""
    with served_app_beside_offline_llm(APP, ARGS, grpc=True) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="key-alice", max_retries=0)


def _post(
    url: str, path: str, body, key: str | None = "key-alice", timeout=60, headers=None
) -> httpx.Response:
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=timeout)


def _offline_text(llm: LLM, prompt, max_tokens: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return llm.generate(prompt, params)[0].outputs[0].text


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_retrieve_model_and_version(served, client):
    url, _ = served
    card = client.models.retrieve(MODEL)
    assert (card.id, card.max_model_len) == (MODEL, MAX_MODEL_LEN)
    with pytest.raises(openai.NotFoundError, match="`gpt-4` does not exist"):
        client.models.retrieve("gpt-4")
    assert httpx.get(f"{url}/v1/models/{MODEL}", timeout=10).status_code == 401
    version = httpx.get(f"{url}/version", timeout=10)
    assert version.status_code == 200 and version.json()["version"][0].isdigit()


def test_completions_match_offline_llm_stream_or_not(served, client):
    _, llm = served
    full = client.completions.create(model=MODEL, prompt=PROMPT, **FAST)
    assert full.choices[0].text == _offline_text(llm, PROMPT, 8)
    assert full.usage.prompt_tokens == len(
        llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    )
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **FAST
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_a_response_s_id_carries_its_x_request_id(served):
    url, _ = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    named = _post(url, "/v1/completions", body, headers={"X-Request-Id": "trace-42"})
    assert named.json()["id"] == "cmpl-trace-42"
    assert named.headers["x-request-id"] == "trace-42"
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    unnamed = _post(url, "/v1/chat/completions", chat)
    assert unnamed.json()["id"] == f"chatcmpl-{unnamed.headers['x-request-id']}"


def test_chat_matches_offline_llm_and_counts_usage(served, client):
    _, llm = served
    full = client.chat.completions.create(model=MODEL, messages=CHAT, **FAST)
    prompt_ids = apply_chat_template(llm.get_tokenizer(), CHAT)
    assert full.choices[0].message.content == _offline_text(llm, prompt_ids, 8)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}, **FAST
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens == len(prompt_ids)
    assert usage.completion_tokens == 8 and usage.total_tokens == len(prompt_ids) + 8


def test_return_token_ids_give_the_ids_the_engine_computed(served, client):
    _, llm = served
    ids = {"return_token_ids": True}
    offline = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0]
    full = client.completions.create(model=MODEL, prompt=PROMPT, extra_body=ids, **FAST)
    assert full.choices[0].prompt_token_ids == offline.prompt_token_ids
    assert full.choices[0].token_ids == offline.outputs[0].token_ids
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, stream=True, extra_body=ids, **FAST)
    )
    assert chunks[0].choices[0].prompt_token_ids == offline.prompt_token_ids
    assert [t for c in chunks for t in c.choices[0].token_ids] == full.choices[0].token_ids
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, extra_body=ids, **FAST)
    assert chat.prompt_token_ids == apply_chat_template(llm.get_tokenizer(), CHAT)
    assert llm.get_tokenizer().decode(chat.choices[0].token_ids) == chat.choices[0].message.content


def test_tokenize_counts_what_a_request_computes_and_detokenize_inverts_it(served, client):
    url, _ = served
    completion = client.completions.create(model=MODEL, prompt=PROMPT, **FAST)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, **FAST)
    by_prompt = _post(url, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert by_prompt.status_code == 200, by_prompt.text
    tokens = by_prompt.json()
    assert tokens["count"] == len(tokens["tokens"]) == completion.usage.prompt_tokens
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    assert _post(url, "/tokenize", {"messages": CHAT}).json()["count"] == chat.usage.prompt_tokens
    assert _post(url, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": PROMPT}
    assert _post(url, "/tokenize", {"prompt": PROMPT}, key=None).status_code == 401
    bad = _post(url, "/detokenize", {"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_json_response_formats_through_the_openai_client(client):
    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "A person as JSON, please."}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": person}}
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=64, response_format=schema_format
    )
    assert reply.choices[0].finish_reason == "stop"
    assert set(json.loads(reply.choices[0].message.content)) == {"name", "age"}
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=64,
        response_format=schema_format,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    anything = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, response_format={"type": "json_object"}
    )
    choice = anything.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objectx"}},
            },
        )


def test_tool_calls_through_the_openai_client(client):
    city = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    asked = dict(model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=48)
    reply = client.chat.completions.create(tool_choice=named, **asked)
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), city)
    assert choice.finish_reason == "stop" and choice.message.content is None
    chunks = list(client.chat.completions.create(tool_choice=named, stream=True, **asked))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("chatcmpl-tool-") and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    # "auto" reaches the replica's hermes parser (without it, a 400).
    auto = client.chat.completions.create(**asked)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(
            tool_choice={"type": "function", "function": {"name": "nope"}}, **asked
        )


def test_sixteen_concurrent_streams_all_complete_correctly(served, client):
    _, llm = served
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(16)]
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(**FAST))]

    def stream(prompt: str) -> str:
        chunks = client.completions.create(model=MODEL, prompt=prompt, stream=True, **FAST)
        return "".join(c.choices[0].text for c in chunks)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(stream, prompts))
    assert got == expected


BAD_INPUTS = [
    ("/v1/chat/completions", "{not json", 400, "JSON"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": "many"},
        400,
        "max_tokens",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 10**7}, 400, "max_tokens"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "temperature": -0.5},
        400,
        "temperature",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "role",
    ),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": CHAT}, 404, "no-such-model"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "word " * (MAX_MODEL_LEN + 10)},
        400,
        "max_model_len",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "nonsense": 1}, 400, "nonsense"),
]


def test_bad_input_is_a_4xx_naming_the_problem_while_others_are_served(served):
    url, _ = served
    # A long request streams the whole time the bad ones arrive.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "ignore_eos": True, "stream": True}
    result: dict = {}
    streamer = threading.Thread(target=lambda: result.update(r=_post(url, "/v1/completions", body)))
    streamer.start()
    for path, bad, status, words in BAD_INPUTS:
        response = _post(url, path, bad)
        assert response.status_code == status, (bad, response.text)
        error = response.json()["error"]
        assert words in error["message"], (bad, error)
        assert set(error) == {"message", "type", "param", "code"}
    streamer.join()
    assert result["r"].status_code == 200
    assert result["r"].text.rstrip().endswith("data: [DONE]")


def test_auth_routes_and_body_size(served):
    url, _ = served
    assert _post(url, "/v1/completions", {"prompt": PROMPT}, key=None).status_code == 401
    assert _post(url, "/v1/completions", {"prompt": PROMPT}, key="wrong").status_code == 401
    missing = httpx.get(f"{url}/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()
    huge = _post(url, "/v1/completions", {"prompt": "x" * (9 << 20)})
    assert huge.status_code == 413
    assert httpx.get(f"{url}/health").status_code == 200


def test_client_disconnect_mid_stream_frees_kv(served):
    url, _ = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    headers = {"Authorization": "Bearer key-alice"}
    elapsed, stats = leave_a_stream_midway(url, body, APP, headers=headers)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, stats
    assert elapsed < 2


def test_client_disconnect_while_waiting_for_a_full_response_frees_kv(served):
    url, _ = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        _post(url, "/v1/completions", body, timeout=1.5)
    elapsed, stats = wait_until_idle(APP, timeout_s=2)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, stats


def test_request_timeout_aborts_and_frees_kv(served):
    url, _ = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    start = time.monotonic()
    response = _post(url, "/v1/completions", body, key="key-hasty")
    assert response.status_code == 408, response.text
    assert "request_timeout_s" in response.json()["error"]["message"]
    assert time.monotonic() - start < 5
    elapsed, stats = wait_until_idle(APP, timeout_s=2)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, stats


def test_overload_gets_429_quickly_and_admitted_requests_finish(served):
    url, _ = served
    # Long enough that no admitted request finishes while the burst is still arriving.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "ignore_eos": True}
    capacity = ARGS["max_ongoing_requests"] + ARGS["max_queued_requests"]
    n_requests = 4 * capacity

    def call(_):
        start = time.monotonic()
        response = _post(url, "/v1/completions", body)
        return response, time.monotonic() - start

    with concurrent.futures.ThreadPoolExecutor(n_requests) as pool:
        results = list(pool.map(call, range(n_requests)))
    codes = [r.status_code for r, _ in results]
    assert set(codes) <= {200, 429}, codes
    # Serve counts the queue in the ingress's router, which lags a burst on a busy 2-core box
    # (39 admitted against a bound of 24 seen here): the bound must hold within 2x, so at
    # least half of the burst is turned away.
    assert codes.count(200) <= 2 * capacity, codes
    # Quickly: every 429 is back before the first admitted request finishes (a 2-core CI
    # box under 96 connections answers them in 0.7-1.7 s, admitted ones take 5-14 s).
    rejected = [t for r, t in results if r.status_code == 429]
    admitted = [t for r, t in results if r.status_code == 200]
    assert max(rejected) < min(admitted), (sorted(rejected), sorted(admitted))
    assert all(r.headers.get("retry-after") for r, _ in results if r.status_code == 429)
    for response, _ in results:
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] == 32
    assert _post(url, "/v1/completions", {**body, "max_tokens": 2}).status_code == 200


def test_tenant_over_its_concurrency_gets_429_while_another_is_served(served):
    url, _ = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"Authorization": "Bearer key-capped"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # dropping this iterator would close the connection
        next(lines)
        second = _post(url, "/v1/completions", {**body, "stream": False}, key="key-capped")
        assert second.status_code == 429 and second.headers.get("retry-after")
        assert "capped" in second.json()["error"]["message"]
        other = _post(
            url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **FAST}, key="key-bob"
        )
        assert other.status_code == 200
    wait_until_idle(APP, timeout_s=2)
    # The held stream's slot goes back when the ingress sees the disconnect, shortly after.
    deadline = time.monotonic() + 5
    while True:
        again = _post(
            url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **FAST}, key="key-capped"
        )
        if again.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert again.status_code == 200


def test_tenant_over_its_tokens_per_minute_gets_429(served):
    url, _ = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True}
    first = _post(url, "/v1/completions", body, key="key-metered")
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] > 20
    second = _post(url, "/v1/completions", body, key="key-metered")
    assert second.status_code == 429
    assert 1 <= int(second.headers["retry-after"]) <= 60
    assert _post(url, "/v1/completions", body, key="key-bob").status_code == 200


def test_prefix_cache_is_shared_within_a_tenant_only(served):
    url, _ = served
    prompt = " ".join(f"Ledger line {i} records a delivery of {i * 7} crates." for i in range(12))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}

    def hits_after(key: str) -> int:
        before = server_stats(APP)["prefix_cache_hits"]
        assert _post(url, "/v1/completions", body, key=key).status_code == 200
        return server_stats(APP)["prefix_cache_hits"] - before

    assert hits_after("key-alice") == 0
    assert hits_after("key-bob") == 0
    assert hits_after("key-alice") >= 64
    assert hits_after("key-bob") >= 64


# gRPC (kvray.v1.InferenceService) on the same app.

LONG = {"max_tokens": 400, "ignore_eos": True}


def _key(name: str = "key-alice") -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {name}")]


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def channel(url):
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port()}") as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.InferenceServiceStub(channel)


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
    expected = _post(url, path, http_body).json()
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
    http = _post(url, "/v1/completions", body, key=key)
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
    http = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, key="key-capped")
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


def test_a_unary_call_past_its_client_deadline_frees_kv(stub):
    with pytest.raises(grpc.RpcError) as error:
        stub.Generate(_grpc_request({"prompt": PROMPT, **LONG}), metadata=_key(), timeout=1)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _, stats = wait_until_idle(APP, timeout_s=2)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, stats


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
    http = _post(url, "/tokenize", {"messages": CHAT}).json()
    messages = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
    tokens = stub.Tokenize(pb.TokenizeRequest(messages=messages), metadata=_key())
    assert (list(tokens.tokens), tokens.count) == (http["tokens"], http["count"])
    models = stub.Models(pb.ModelsRequest(), metadata=_key())
    assert [(m.id, m.max_model_len) for m in models.models] == [(MODEL, MAX_MODEL_LEN)]
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


def test_an_app_whose_grpc_port_serve_does_not_serve_fails_to_build_naming_the_key(url):
    from serve_app import build_app

    with pytest.raises(ValueError, match=rf"grpc_port={grpc_port() + 1}: .* on port {grpc_port()}"):
        build_app({**ARGS, "grpc_port": grpc_port() + 1})


def test_a_stream_past_its_time_limit_ends_deadline_exceeded(stub):
    stream = stub.GenerateStream(
        _grpc_request({"prompt": PROMPT, **LONG}), metadata=_key("key-hasty")
    )
    with pytest.raises(grpc.RpcError) as error:
        for _ in stream:
            pass
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "request_timeout_s" in error.value.details()
    _, stats = wait_until_idle(APP, timeout_s=2)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, stats


def test_the_serving_page_s_grpc_client_example_runs(served, capsys):
    page = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.DOTALL) if "grpc" in b]
    example = example.replace("127.0.0.1:9000", f"127.0.0.1:{grpc_port()}")
    names: dict = {}
    exec(compile(example.replace("my-key", "key-alice"), "serving.md", "exec"), names)
    reply, last = names["reply"], names["message"]
    assert reply.choices[0].text and 0 < reply.usage.completion_tokens <= 8
    assert 0 < last.usage.completion_tokens <= 32  # the stream's last message: its usage
    assert capsys.readouterr().out.startswith(reply.choices[0].text)
