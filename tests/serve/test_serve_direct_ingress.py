"""Serve's direct ingress (cluster/topology.py DIRECT_INGRESS_ENV): HAProxy holds the HTTP
port and forwards to the ingress replicas' own HTTP servers. A client that goes away still
aborts its request, in both layouts (ingress -> LLMServer, and colocate_ingress).

Ray runs with DIRECT_INGRESS_ENV for this module (tests/support/serve_apps.py restarts it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cluster.topology import DIRECT_INGRESS_ENV
from tests.support.serve_apps import (
    leave_a_stream_midway,
    served_app,
    server_stats,
    wait_until_idle,
)

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
# An ingress replica drains for 30 s by default before it stops (Serve's direct ingress).
ENV = {**DIRECT_INGRESS_ENV, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
ARGS = {"max_model_len": 512, "max_num_seqs": 8, "num_cpus": 0.25, "engine_process": True}
LAYOUTS = {
    # app name: (extra args, the deployment that holds the engine)
    "direct-separate": ({"ingress_max_replicas": 1, "ingress_num_cpus": 0.25}, "LLMServer"),
    "direct-colocated": ({"colocate_ingress": True}, "OpenAIIngress"),
}
LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request):
    """(base URL, app name, deployment holding the engine), one layout at a time."""
    name = request.param
    extra, deployment = LAYOUTS[name]
    with served_app(name, {**ARGS, **extra}, ENV) as url:
        yield url, name, deployment


def _wait_until_running(name: str, deployment: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while server_stats(name, deployment)["num_running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)


def _post_then_leave(url: str, name: str, deployment: str) -> None:
    """POST a long completion with its body sent after its headers (as httpx sends it;
    HAProxy then forwards the body by splice), and close the connection once it runs."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(LONG).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(head.encode())
        time.sleep(0.05)
        conn.sendall(body)
        _wait_until_running(name, deployment)


def test_answers_stream_or_not(served):
    url, _, _ = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    full = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert full.status_code == 200, full.text
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
    assert "".join(text) == full.json()["choices"][0]["text"]


def test_every_client_disconnect_while_waiting_for_a_full_response_frees_kv(served):
    url, name, deployment = served
    # Several in a row: the first requests may still go through Serve's proxy (HAProxy's
    # fallback) until HAProxy has the replica; each must be aborted.
    for i in range(3):
        _post_then_leave(url, name, deployment)
        elapsed, stats = wait_until_idle(name, timeout_s=2, deployment=deployment)
        assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, (i, stats)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=LONG, timeout=1.5)
    elapsed, stats = wait_until_idle(name, timeout_s=2, deployment=deployment)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, stats


def test_client_disconnect_mid_stream_frees_kv(served):
    url, name, deployment = served
    elapsed, stats = leave_a_stream_midway(url, {**LONG, "stream": True}, name, deployment)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0, stats


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_haproxy_ends_with_the_process_that_started_it(tmp_path):
    """`ray stop --force` kills Serve's HAProxy manager; its HAProxy must not stay behind
    holding the HTTP port."""
    fake = tmp_path / "haproxy"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    wrapper = DIRECT_INGRESS_ENV["RAY_SERVE_HAPROXY_BINARY_PATH"]
    code = (
        "import subprocess, time\n"
        f"child = subprocess.Popen([{wrapper!r}, '-db'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "KVRAY_HAPROXY_BINARY": str(fake)},
    )
    pid = int(starter.stdout.readline())
    deadline = time.monotonic() + 10
    while b"sleep" not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the wrapper never started its binary"
        time.sleep(0.02)
    starter.kill()
    starter.wait()
    deadline = time.monotonic() + 5
    while _running(pid):
        assert time.monotonic() < deadline, "HAProxy outlived the process that started it"
        time.sleep(0.05)
