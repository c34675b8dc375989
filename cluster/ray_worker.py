"""One rank of a Ray actor group: `RayWorker` hosts the rank's engine `Worker` in an actor
process of its own (cluster/executor.py starts one per rank and drives them).

A call to `execute_model` launches a step and answers with the step launched by the call
before, so the next step is on the device before the rank waits for the last one.
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch

import kvray_env
from cluster.topology import free_port
from engine.config import EngineConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.distributed import destroy_distributed, init_distributed
from engine.observability.gc_pauses import freeze_startup_heap
from engine.worker.loader import ModelSource
from engine.worker.model_runner import PendingRunnerOutput
from engine.worker.worker import Worker

FORWARDED_ENV = kvray_env.FORWARDED_TO_RANKS
"""kvray's switches that reach the workers from the process that starts them, also on a
cluster whose raylets were started without them."""


def worker_runtime_env() -> dict[str, Any] | None:
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    return {"env_vars": env} if env else None


@ray.remote(concurrency_groups={"health": 1, "control": 1})
class RayWorker:
    """Hosts one rank's `engine.worker.worker.Worker` in its own process."""

    def __init__(self, num_threads: int):
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        torch.set_num_threads(num_threads)
        self.worker: Worker | None = None
        self._in_flight: PendingRunnerOutput | _FailedLaunch | None = None

    def node_info(self) -> dict[str, Any]:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def free_port(self) -> int:
        return free_port()

    def init_worker(
        self,
        config: EngineConfig,
        hf_config: Any,
        source: ModelSource,
        rank: int,
        init_method: str,
        group_devices: str | None = None,
    ) -> None:
        """`group_devices`: the CUDA_VISIBLE_DEVICES of this rank's whole tensor-parallel
        group when it shares one node, so that the ranks can map each other's memory for
        the peer-memory all-reduce; the rank's own GPU is the group's entry at its
        tensor-parallel rank. None keeps the one GPU Ray gave the actor."""
        parallel = config.parallel_config
        local_rank = 0
        if group_devices is not None and not torch.cuda.is_initialized():
            os.environ["CUDA_VISIBLE_DEVICES"] = group_devices
            # A device count read before this line keeps CUDA on the actor's one GPU.
            if torch.cuda.device_count() == len(group_devices.split(",")):
                local_rank = rank % parallel.tensor_parallel_size
        backend = "nccl" if config.device == "cuda" else "gloo"
        init_distributed(
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            rank,
            backend=backend,
            init_method=init_method,
        )
        self.worker = Worker(config, hf_config, source, rank=rank, local_rank=local_rank)
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def kv_swap_info(self) -> dict[str, float] | None:
        return self.worker.kv_swap_info()

    def execute_model(self, scheduler_output: SchedulerOutput | None) -> ModelRunnerOutput | None:
        """Launch this step, then answer with the output of the step launched by the call
        before (None for none). The next step is on the device before this rank waits for
        the last one, so the device does not idle while the host prepares a step.
        `scheduler_output` None launches nothing: it only collects the last step."""
        previous, self._in_flight = self._in_flight, None
        if scheduler_output is not None:
            try:
                self._in_flight = self.worker.execute_model_async(scheduler_output)
            except Exception as e:
                # Raised with the call that collects this step, not the one before.
                self._in_flight = _FailedLaunch(e)
        if previous is None:
            return None
        output = previous.result()
        return output if self.worker.runner.is_driver else None

    def weight_bytes(self) -> int:
        return self.worker.weight_bytes()

    # The compiled graph's loop holds the default group once steps have run.
    @ray.method(concurrency_group="health")
    def warn_of_late_kernel_variants(self) -> None:
        self.worker.warn_of_late_kernel_variants()

    @ray.method(concurrency_group="health")
    def freeze_startup_heap(self) -> None:
        freeze_startup_heap()

    # Off the default group, which the compiled graph's loop holds; called with no step in flight.
    @ray.method(concurrency_group="control")
    def collective_rpc(self, method: str, *args: Any) -> Any:
        """`Worker.<method>(*args)` on this rank (Executor.collective_rpc)."""
        return getattr(self.worker, method)(*args)

    @ray.method(concurrency_group="health")
    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        destroy_distributed()


class _FailedLaunch:
    def __init__(self, error: Exception):
        self.error = error

    def result(self) -> ModelRunnerOutput:
        raise self.error
