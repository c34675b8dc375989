"""The Serve app end to end: real Ray Serve, real HTTP on 127.0.0.1, the official client.

One app (bundled SmolLM2 on CPU) serves the whole module; tenants come from API keys. Its
engine runs in an engine process, as on one GPU (test_cluster_serve covers the engine on a
thread of the replica, as with tensor parallelism).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from engine import LLM, SamplingParams
from engine.tokenizer import apply_chat_template
from tests.support.serve_apps import (
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
    with served_app_beside_offline_llm(APP, ARGS) as served:
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
    assert response.status_code == 408
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
