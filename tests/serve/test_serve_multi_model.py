"""Two models in one Serve app, end to end: real Ray Serve, real HTTP, the official client.

The bundled SmolLM2 twice, under two served names with different settings (context
length, batch size, replicas' own deployments); each answers the offline engine's greedy
text (one offline engine for both: a context length that the prompt fits in either does not
change greedy tokens), and a tenant's limit spans both.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from engine import SamplingParams
from engine.tokenizer import apply_chat_template
from tests.support.serve_apps import served_app_beside_offline_llm, server_stats

APP = "multi"
LONG, SHORT = "smol-long", "smol-short"
MAX_MODEL_LEN = {LONG: 512, SHORT: 256}
ARGS = {
    "models": [
        {
            "served_model_name": LONG,
            "max_model_len": MAX_MODEL_LEN[LONG],
            "max_num_seqs": 8,
            "cpu_kv_cache_gib": 0.1,
            "num_cpus": 0.25,
        },
        {
            "served_model_name": SHORT,
            "max_model_len": MAX_MODEL_LEN[SHORT],
            "max_num_seqs": 4,
            "cpu_kv_cache_gib": 0.1,
            "num_cpus": 0.25,
        },
    ],
    "ingress_max_replicas": 1,
    "api_keys": {"key-a": "a", "key-capped": "capped"},
    "tenants": {"capped": {"max_concurrent_requests": 1}},
}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
FAST = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def served():
    """(base URL, offline LLM): the replicas and the local LLM load at the same time."""
    offline = dict(max_model_len=MAX_MODEL_LEN[LONG], cpu_kv_cache_gib=0.1)
    with served_app_beside_offline_llm(APP, ARGS, **offline) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="key-a", max_retries=0)


def test_models_lists_both_served_names_with_their_context(client):
    listed = client.models.list().data
    assert [(m.id, m.max_model_len) for m in listed] == [(LONG, 512), (SHORT, 256)]


def test_retrieve_model_answers_each_card_and_404s_other_names(client):
    for name in (LONG, SHORT):
        card = client.models.retrieve(name)
        assert (card.id, card.max_model_len) == (name, MAX_MODEL_LEN[name])
    for unknown in ("smol", "org/smol-long"):
        with pytest.raises(openai.NotFoundError, match=f"`{unknown}` does not exist") as e:
            client.models.retrieve(unknown)
        assert e.value.code == "model_not_found" and LONG in str(e.value)


def test_each_model_answers_the_offline_engines_greedy_text(served, client):
    _, llm = served
    params = SamplingParams(**FAST)
    expected = llm.generate(PROMPT, params)[0].outputs[0].text
    prompt_ids = apply_chat_template(llm.get_tokenizer(), CHAT)
    expected_chat = llm.generate(prompt_ids, params)[0].outputs[0].text
    for name in MAX_MODEL_LEN:
        completion = client.completions.create(model=name, prompt=PROMPT, **FAST)
        assert completion.model == name
        assert completion.choices[0].text == expected
        chat = client.chat.completions.create(model=name, messages=CHAT, stream=True, **FAST)
        text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        assert text == expected_chat


def test_requests_reach_the_named_models_own_deployment(served, client):
    url, _ = served
    long_prompt = "word " * 300  # fits 512 tokens, not 256
    assert client.completions.create(model=LONG, prompt=long_prompt, max_tokens=1).usage
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=SHORT, prompt=long_prompt, max_tokens=1)
    headers = {"Authorization": "Bearer key-a"}
    for name, length in MAX_MODEL_LEN.items():
        tokens = httpx.post(
            f"{url}/tokenize", json={"model": name, "prompt": PROMPT}, headers=headers
        )
        assert tokens.json()["max_model_len"] == length
    finished = server_stats(APP, f"LLMServer:{SHORT}")
    assert finished["num_running"] == 0


def test_unknown_or_missing_model_is_an_openai_error_naming_the_models(served, client):
    url, _ = served
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=1)
    missing = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 1},
        headers={"Authorization": "Bearer key-a"},
    )
    assert missing.status_code == 400
    assert f"`{LONG}`, `{SHORT}`" in missing.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_a_tenants_concurrency_limit_spans_every_model(served):
    url, _ = served
    headers = {"Authorization": "Bearer key-capped"}
    body = {"model": LONG, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # dropping this iterator would close the connection
        next(lines)
        other = httpx.post(
            f"{url}/v1/completions",
            json={"model": SHORT, "prompt": PROMPT, "max_tokens": 1},
            headers=headers,
            timeout=60,
        )
        assert other.status_code == 429 and "capped" in other.json()["error"]["message"]
