"""Ray Serve apps for tests: one local Ray instance per test process (under xdist, each
worker that runs one of tests/support/tiers.py's Ray groups), HTTP on a free port of
127.0.0.1, and helpers to run and inspect one app per module. A module's app fixture holds
`served_app` (or `served_app_beside_offline_llm`) open for the module's tests."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

_state: dict[str, Any] = {}


def start_ray(env: dict[str, str] | None = None) -> str:
    """Start Ray + Serve once per session; returns the HTTP base URL. Serve's proxy also
    serves kvray's gRPC API, on a free port (`grpc_port()`).

    `env`: variables for the Ray processes (Serve's controller, proxies and HAProxy read
    theirs at start), a variable already set in this process wins; a module asking for
    another `env` than the running Ray's restarts Ray.
    """
    env = env or {}
    if "url" in _state:
        if _state["env"] == env:
            return _state["url"]
        stop_ray()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Autoscaling metrics every 0.5 s instead of 10 s (read by the controller at start).
    os.environ["RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    os.environ["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    environ = dict(os.environ)
    for key, value in env.items():
        os.environ.setdefault(key, value)
    from cluster.topology import use_serve_fast_path

    use_serve_fast_path()  # as `serve run serve_app:...` does: the proxy reads it at start
    import ray
    from ray import serve

    from cluster.grpc_api.serve_setup import grpc_options

    ray.init(num_cpus=2, address="local", include_dashboard=False, object_store_memory=1 << 30)
    port = _free_port()
    grpc_port = _free_port()
    serve.start(
        http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc_options(grpc_port)
    )
    _state.update(url=f"http://127.0.0.1:{port}", env=env, environ=environ, grpc_port=grpc_port)
    return _state["url"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grpc_port() -> int:
    """The gRPC port of the session's Serve."""
    return _state["grpc_port"]


def stop_ray() -> None:
    """Stop the session's Ray and put back the environment it started from."""
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    os.environ.clear()
    os.environ.update(_state["environ"])
    _state.clear()


def run_app(
    name: str, args: dict[str, Any], env: dict[str, str] | None = None, grpc: bool = False
) -> str:
    """Deploy `serve_app:build_app(args)` at / of a Ray started with `env`; returns the
    base URL. `grpc`: the app's grpc_port is the session's (its build checks that Serve
    serves kvray's gRPC API there)."""
    from ray import serve

    from serve_app import build_app

    url = start_ray(env)
    if grpc:
        args = {**args, "grpc_port": grpc_port()}
    serve.run(build_app(args), name=name, route_prefix="/")
    return url


@contextlib.contextmanager
def served_app(
    name: str, args: dict[str, Any], env: dict[str, str] | None = None, grpc: bool = False
) -> Iterator[str]:
    """The app of `args` deployed as `name` (run_app) for the block: its base URL. The app
    is deleted when the block ends, so the next module's app gets the route."""
    url = run_app(name, args, env, grpc)
    try:
        yield url
    finally:
        delete_app(name)


@contextlib.contextmanager
def served_app_beside_offline_llm(
    name: str,
    args: dict[str, Any],
    env: dict[str, str] | None = None,
    grpc: bool = False,
    **llm_args: Any,
) -> Iterator[tuple[str, Any]]:
    """served_app, while an offline LLM of the bundled model (the app's max_model_len
    unless `llm_args` say otherwise) loads in a thread: (base URL, LLM), the reference the
    app's answers are held to."""
    from engine import LLM

    if "max_model_len" in args:
        llm_args.setdefault("max_model_len", args["max_model_len"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        offline = pool.submit(LLM, **llm_args)
        with served_app(name, args, env, grpc) as url:
            yield url, offline.result()


def delete_app(name: str) -> None:
    from ray import serve

    serve.delete(name)


def server_stats(app_name: str, deployment: str = "LLMServer") -> dict:
    """The engine's counters, from the deployment that holds the engine."""
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name).stats.remote().result()


def wait_until_idle(
    app_name: str, timeout_s: float, deployment: str = "LLMServer"
) -> tuple[float, dict]:
    """Poll the engine until nothing runs and no KV block is used; (seconds taken, stats)."""
    start = time.monotonic()
    while True:
        stats = server_stats(app_name, deployment)
        idle = stats["num_running"] + stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0
        elapsed = time.monotonic() - start
        if idle or elapsed > timeout_s:
            return elapsed, stats
        time.sleep(0.05)


def leave_a_stream_midway(
    url: str, body: dict, app_name: str, deployment: str = "LLMServer", headers=None
) -> tuple[float, dict]:
    """Stream a completion, check it runs after a few events, close the connection; then
    wait_until_idle's (seconds taken, stats) with 2 s to free it."""
    import httpx

    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert server_stats(app_name, deployment)["num_running"] == 1
    return wait_until_idle(app_name, timeout_s=2, deployment=deployment)


def running_replicas(app_name: str, deployment: str = "LLMServer") -> int:
    from ray import serve

    status = serve.status().applications[app_name].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)
