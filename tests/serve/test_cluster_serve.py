"""A tensor-parallel replica through Ray Serve: TP=3 serves TP=1's answers; when one of its
ranks is killed mid-generation the request ends with an error within seconds, Serve
replaces the replica and the next request succeeds."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import psutil
import pytest

from engine import SamplingParams
from tests.support.serve_apps import served_app_beside_offline_llm

APP = "tp3"
ARGS = {
    "tensor_parallel_size": 3,
    "max_model_len": 256,
    "cpu_kv_cache_gib": 0.05,
    "max_num_seqs": 4,
    "num_cpus": 0.25,
    "ingress_max_replicas": 1,
}
PROMPTS = ["The capital of France is", "Water boils at"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def served():
    """(base URL, TP=1 offline texts): the replica and the local LLM load at the same time."""
    with served_app_beside_offline_llm(APP, ARGS, cpu_kv_cache_gib=0.05) as (url, llm):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
        yield url, texts


def _complete(url: str, prompt: str, timeout: float = 60) -> httpx.Response:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "temperature": 0}
    body["max_tokens"] = MAX_TOKENS
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def _rank_processes() -> list[psutil.Process]:
    """The worker actors of this test session's Ray instance (never another session's)."""
    found = []
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if p.cmdline() and p.cmdline()[0].startswith("ray::RayWorker"):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def test_tp3_replica_serves_tp1_answers(served):
    url, texts = served
    for prompt, want in zip(PROMPTS, texts):
        response = _complete(url, prompt)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == want
    assert len(_rank_processes()) == 3


def test_killed_rank_errors_the_request_and_the_replica_is_replaced(served):
    url, texts = served
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "choices" in first
        victims = _rank_processes()
        assert len(victims) == 3
        victims[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        rest = list(lines)
    assert time.monotonic() - killed_at < 10
    events = [line.removeprefix("data: ") for line in rest if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in e]
    assert errors and "WorkerDiedError" in errors[0]["message"]

    deadline = time.monotonic() + 240
    while True:
        try:
            response = _complete(url, PROMPTS[1], timeout=30)
            if response.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the replica was not replaced in time"
        time.sleep(0.5)
    assert response.json()["choices"][0]["text"] == texts[1]
    new_ranks = _rank_processes()
    assert len(new_ranks) == 3
    assert not {p.pid for p in new_ranks} & {p.pid for p in victims}
