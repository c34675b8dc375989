"""Topology: `python -m cluster local` runs a head and a worker raylet on this machine; a
PP=2 group spans the two nodes with unchanged output; stopping leaves no process behind.

The driver runs in a child process: this test process may already be the driver of the
session's single-node Ray instance.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from ray._private.utils import read_ray_address

from cluster.topology import ray_start_command
from engine import LLM, SamplingParams
from tests.support.tiny_models import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 99, 3, 200, 41], [250, 7, 7, 12]]
ARGS = dict(max_model_len=128, num_gpu_blocks=64, block_size=4)
DRIVER = """
import json, sys
import ray
from cluster.executor import RayActorGroupExecutor
from engine import LLM, SamplingParams
ray.init(logging_level="ERROR")
llm = LLM(
    sys.argv[1],
    pipeline_parallel_size=2,
    distributed_executor_backend=RayActorGroupExecutor,
    **json.loads(sys.argv[2]),
)
params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
outputs = llm.generate(json.loads(sys.argv[3]), params)
executor = llm.engine.executor
print(json.dumps({
    "node_ids": executor.node_ids,
    "nodes": [n["NodeID"] for n in ray.nodes() if n["Alive"]],
    "tokens": [o.outputs[0].token_ids for o in outputs],
}))
llm.engine.shutdown()
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_AUTH_MODE="disabled", **extra)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


@pytest.fixture(scope="module")
def local_cluster():
    """(address, the launcher process) of `python -m cluster local --workers 1`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster", "local", "--workers", "1", "--num-cpus", "1"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert " at " in line, f"launcher said {line!r} (exit code {proc.poll()})"
        yield line.rsplit(" at ", 1)[1].split()[0], proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_pp2_stages_land_on_two_nodes_with_unchanged_output(local_cluster, tmp_path):
    address, _ = local_cluster
    path = write_tiny_llama(tmp_path / "tiny")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, **ARGS).generate(PROMPTS, params)]

    result = subprocess.run(
        [sys.executable, "-c", DRIVER, path, json.dumps(ARGS), json.dumps(PROMPTS)],
        cwd=ROOT,
        env=_env(RAY_ADDRESS=address),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report["nodes"]) == 2
    # One CPU per node and one CPU per rank: each stage needs a node of its own.
    assert sorted(report["node_ids"]) == sorted(report["nodes"])
    assert report["tokens"] == want


def test_stopping_the_local_cluster_leaves_no_process(local_cluster):
    address, launcher = local_cluster
    port = address.rsplit(":", 1)[-1]
    started = psutil.Process(launcher.pid).children(recursive=True)
    names = {p.name() for p in started}
    assert {"gcs_server", "raylet"} <= names
    assert sum(p.name() == "raylet" for p in started) == 2
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == 0
    _, alive = psutil.wait_procs(started, timeout=10)
    assert not alive, [(p.pid, p.name()) for p in alive]
    # A later bare ray.init() on this machine must not try to join the stopped cluster.
    assert not read_ray_address() or read_ray_address().rsplit(":", 1)[-1] != port


def test_ray_start_commands_carry_kvray_ports():
    head = ray_start_command(head=True, port=6380, num_gpus=0)
    assert "--head" in head and "--port=6380" in head and "--num-gpus=0" in head
    assert "--metrics-export-port=8080" in head
    worker = ray_start_command(head=False, address="10.0.0.1:6380", resources={"a": 1})
    assert "--address=10.0.0.1:6380" in worker and '--resources={"a": 1}' in worker
    assert "--head" not in worker
    with pytest.raises(ValueError, match="worker node needs"):
        ray_start_command(head=False)


def _group_devices(device: str, tp: int, pp: int, infos: list[dict]) -> list[str | None]:
    from types import SimpleNamespace

    from cluster.executor import RayActorGroupExecutor

    executor = RayActorGroupExecutor.__new__(RayActorGroupExecutor)
    executor.config = SimpleNamespace(device=device)
    executor.tp_size, executor.world_size, executor.node_infos = tp, tp * pp, infos
    return executor._tensor_parallel_group_devices()


def test_a_tensor_parallel_group_on_one_node_sees_its_own_gpus_only():
    infos = [
        {"node_id": "a", "cuda_visible_devices": "0"},
        {"node_id": "a", "cuda_visible_devices": "3"},
        {"node_id": "a", "cuda_visible_devices": "1"},
        {"node_id": "b", "cuda_visible_devices": "0"},
    ]
    # TP=2 x PP=2: stage 0's group shares node a; stage 1's spans two nodes.
    assert _group_devices("cuda", 2, 2, infos) == ["0,3", "0,3", None, None]
    assert _group_devices("cuda", 1, 4, infos) == [None] * 4
    assert _group_devices("cpu", 2, 2, infos) == [None] * 4
    # A rank that already sees several GPUs, or none, keeps what Ray gave it.
    infos[1]["cuda_visible_devices"] = "3,4"
    assert _group_devices("cuda", 2, 2, infos)[:2] == [None, None]
    infos[1]["cuda_visible_devices"] = None
    assert _group_devices("cuda", 2, 2, infos)[:2] == [None, None]


def test_kvray_switches_reach_the_workers_of_a_group(monkeypatch):
    from cluster.ray_worker import worker_runtime_env

    for name in ("KVRAY_PROFILE_STEPS", "KVRAY_NCCL_ONLY", "KVRAY_TORCH_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    assert worker_runtime_env() is None
    monkeypatch.setenv("KVRAY_NCCL_ONLY", "1")
    monkeypatch.setenv("KVRAY_PROFILE_STEPS", "10:20:/tmp/p")
    monkeypatch.setenv("UNRELATED", "x")
    assert worker_runtime_env() == {
        "env_vars": {"KVRAY_NCCL_ONLY": "1", "KVRAY_PROFILE_STEPS": "10:20:/tmp/p"}
    }
