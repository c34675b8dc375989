"""`colocate_ingress`: the HTTP ingress replicas hold the engine themselves (one
deployment, no Ray call between HTTP and the engine), with the same behaviour."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from engine import SamplingParams
from tests.support.serve_apps import (
    leave_a_stream_midway,
    served_app_beside_offline_llm,
    wait_until_idle,
)

APP = "colocated"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
INGRESS = "OpenAIIngress"
ARGS = {
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 8,
    "max_ongoing_requests": 2,
    "max_queued_requests": 2,
    "num_cpus": 0.25,
    "engine_process": True,
    "colocate_ingress": True,
    "api_keys": {"key-a": "a"},
    "tenants": {"a": {"max_concurrent_requests": 16}},
    # Qwen3's way of thinking, on a model that never ends a thought: its output is all
    # reasoning, unless the request turns thinking off.
    "reasoning_parser": "qwen3",
    "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n<think>\n{% if not enable_thinking %}\n</think>\n\n"
    "{% endif %}",
    "default_chat_template_kwargs": {"enable_thinking": True},
    "enable_prompt_tokens_details": True,
}
PROMPT = "The capital of France is"
HEADERS = {"Authorization": "Bearer key-a"}


@pytest.fixture(scope="module")
def served():
    with served_app_beside_offline_llm(APP, ARGS) as served:
        yield served


def test_one_deployment_holds_the_engine_and_serves_the_offline_answers(served):
    from ray import serve

    url, llm = served
    deployments = serve.status().applications[APP].deployments
    assert INGRESS in deployments and "LLMServer" not in deployments
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    full = httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=60).json()
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0]
    assert full["choices"][0]["text"] == expected.outputs[0].text
    streamed = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=HEADERS
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed.append(line)
    text = "".join(json.loads(s[len("data: ") :])["choices"][0]["text"] for s in streamed)
    assert text == full["choices"][0]["text"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    # Errors keep OpenAI's shape; auth and tenants still apply.
    bad = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": -1}, headers=HEADERS)
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401


def test_client_disconnect_mid_stream_frees_kv(served):
    url, _ = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    elapsed, stats = leave_a_stream_midway(url, body, APP, INGRESS, HEADERS)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, stats


def test_client_disconnect_while_waiting_for_a_full_response_frees_kv(served):
    url, _ = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=1.5)
    elapsed, stats = wait_until_idle(APP, timeout_s=2, deployment=INGRESS)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, stats


def test_overload_gets_openai_429_and_admitted_requests_finish(served):
    url, _ = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
    capacity = ARGS["max_ongoing_requests"] + ARGS["max_queued_requests"]

    def call(_):
        return httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(3 * capacity) as pool:
        responses = list(pool.map(call, range(3 * capacity)))
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429} and codes.count(200) <= capacity, codes
    for r in responses:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "server_overloaded" and r.headers["retry-after"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 24
    elapsed, stats = wait_until_idle(APP, timeout_s=5, deployment=INGRESS)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, stats


def test_the_replica_and_its_engine_process_run_at_normal_priority(served):
    """Ray starts workers at niceness 15, below every other process on the node: Serve's
    fast path (RAY_worker_niceness) keeps the replica, and the engine process it starts,
    level with the proxy and the clients instead."""
    import psutil

    replicas = [
        p
        for p in psutil.process_iter(["cmdline"])
        if any(f"ServeReplica:{APP}:{INGRESS}" in part for part in p.info["cmdline"] or ())
    ]
    assert replicas
    for replica in replicas:
        engine_processes = replica.children()
        assert engine_processes  # engine_process=True: the engine runs in a child
        assert [p.nice() for p in [replica, *engine_processes]] == [0] * (1 + len(engine_processes))


def test_reasoning_and_the_chat_template_keys_reach_the_replica(served):
    url, _ = served
    body = {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 6, "temperature": 0}
    chat = f"{url}/v1/chat/completions"
    thinking = httpx.post(chat, json=body, headers=HEADERS, timeout=60).json()["choices"][0]
    assert thinking["message"]["reasoning"] == thinking["message"]["reasoning_content"]
    assert thinking["message"]["reasoning"] and thinking["message"]["content"] is None
    deltas = []
    with httpx.stream("POST", chat, json={**body, "stream": True}, headers=HEADERS) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[len("data: ") :])["choices"][0]["delta"])
    assert "".join(d.get("reasoning", "") for d in deltas) == thinking["message"]["reasoning"]
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    answer = httpx.post(chat, json=off, headers=HEADERS, timeout=60).json()["choices"][0]
    assert answer["message"]["content"] and "reasoning" not in answer["message"]
    refused = {**body, "chat_template_kwargs": {"add_generation_prompt": False}}
    bad = httpx.post(chat, json=refused, headers=HEADERS, timeout=60)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt"


def test_usage_shows_the_prompt_tokens_the_replica_s_cache_served(served):
    url, _ = served
    prompt = "A long way from here, " * 8  # several full blocks, sent by no other test
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    usages = [
        httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=60).json()["usage"]
        for _ in range(2)
    ]
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert 0 < usages[1]["prompt_tokens_details"]["cached_tokens"] < usages[1]["prompt_tokens"]
