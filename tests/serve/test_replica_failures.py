"""Replicas that die under a real Serve app: their process is killed by its pid, as a crash
or an out-of-memory kill would end it.

Two LLMServer replicas of the bundled model, each taking two requests at once and running
one (max_num_seqs 1): a replica holds a running stream and one its engine has taken but
not scheduled (its response has started: status and headers). What a client sees when one
replica dies, then when both do:

- both streams end with an SSE error event in OpenAI's shape and `[DONE]` (the official
  client raises APIError, not APIConnectionError);
- a request still queued in Serve's handle (no replica had taken it) is routed to the
  other replica by Serve, and served whole;
- a request sent whole whose replica dies gets 503 with Retry-After;
- with no replica left, /health answers 503 within a second and new requests 503 after
  `no_replica_wait_s`, until Serve's new replicas are up.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.support.serve_apps import delete_app, run_app, running_replicas

APP = "failures"
MODEL = "SmolLM2-135M-Instruct"
ARGS = {
    "max_model_len": 256,
    "max_num_seqs": 1,
    "min_replicas": 2,
    "max_replicas": 2,
    "max_ongoing_requests": 2,
    "max_queued_requests": 16,
    "num_cpus": 0.25,
    "ingress_max_replicas": 1,
    "no_replica_wait_s": 1,
}
TOKENS = 32
LONG = {"temperature": 0, "max_tokens": TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def url():
    url = run_app(APP, ARGS)
    yield url
    delete_app(APP)


def _replica_pids() -> list[int]:
    """The pids of the app's LLMServer replicas, asked of each replica's own process."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#LLMServer#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    actors = [ray.get_actor(n, namespace="serve") for n in names if n.startswith(prefix)]
    return ray.get([a.__ray_call__.remote(lambda replica: os.getpid()) for a in actors])


def _wait_for_replicas(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while running_replicas(APP) < 2 or httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the replicas did not come back"
        time.sleep(0.5)


def _stream(client: openai.OpenAI, prompt: str, chunks: list) -> BaseException | None:
    """Read a stream into `chunks`; the exception that ended it, if one did."""
    try:
        for chunk in client.completions.create(model=MODEL, prompt=prompt, stream=True, **LONG):
            chunks.append(chunk)
    except Exception as e:
        return e
    return None


def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_one_replica_dies_under_its_streams(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    chunks: list[list] = [[] for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        streams = [pool.submit(_stream, client, f"Story {i}:", chunks[i]) for i in range(4)]
        # Each replica runs one stream and holds one it has not started.
        _until(lambda: sum(len(c) > 2 for c in chunks) == 2, 120, "two running streams")
        queued = pool.submit(
            httpx.post,
            f"{url}/v1/completions",
            json={"prompt": "Queued:", "max_tokens": 4, "temperature": 0},
            timeout=300,
        )
        time.sleep(0.5)  # in Serve's handle: both replicas hold all they take
        running = [i for i in range(4) if chunks[i]]
        os.kill(_replica_pids()[0], signal.SIGKILL)
        errors = [s.result() for s in streams]
        assert queued.result().status_code == 200

    failed = [i for i, e in enumerate(errors) if e is not None]
    assert len(failed) == 2 and len(set(failed) & set(running)) == 1, errors
    for i in failed:
        error = errors[i]
        assert isinstance(error, openai.APIError)
        assert not isinstance(error, openai.APIConnectionError)
        assert "stopped while it ran this request" in error.message
    for i in set(range(4)) - set(failed):
        assert chunks[i][-1].choices[0].finish_reason == "length"


def test_the_error_event_is_openais_shape_then_done(url):
    _wait_for_replicas(url)
    events: list[str] = []
    body = {"prompt": "Once", "stream": True, "max_tokens": 200, "ignore_eos": True}

    def read() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            events.extend(line for line in r.iter_lines() if line)

    reader = threading.Thread(target=read)
    reader.start()
    _until(lambda: len(events) > 2, 120, "a running stream")
    for pid in _replica_pids():
        os.kill(pid, signal.SIGKILL)
    reader.join(60)
    assert events[-1] == "data: [DONE]"
    error = httpx.Response(200, content=events[-2].removeprefix("data: ")).json()["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert error["code"] == "replica_unavailable"


def test_with_no_replica_left_health_and_requests_answer_503_quickly(url):
    """Continues from the test above: both replicas were killed, Serve starts new ones."""
    start = time.monotonic()
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and time.monotonic() - start < 1
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and time.monotonic() - start < 3, r.text
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "no_replica"
    _wait_for_replicas(url)
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.headers["content-type"] == "application/json"
    assert health.json() == {"status": "healthy", "models": [MODEL]}


def test_a_request_sent_whole_whose_replica_dies_gets_503(url):
    _wait_for_replicas(url)
    body = {"prompt": "Once", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=300)
        time.sleep(2)  # running on one of the replicas
        for pid in _replica_pids():
            os.kill(pid, signal.SIGKILL)
        r = whole.result()
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "replica_unavailable"
    _wait_for_replicas(url)
