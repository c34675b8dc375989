"""Executor: drives the workers of one engine. The in-process one serves a single rank.

Multi-rank executors live outside the engine (the Ray actor group in `cluster/`) and are
looked up by backend name, so the engine never imports Ray.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Protocol

from engine.config import EngineConfig
from engine.loader import ModelSource
from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.worker import Worker

EXECUTOR_BACKENDS = {"ray": "cluster.executor:RayActorGroupExecutor"}


class Executor(ABC):
    def __init__(self, config: EngineConfig, hf_config, source: ModelSource):
        self.config = config
        self.hf_config = hf_config
        self.source = source

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every rank can hold (the minimum over ranks)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    supports_overlap = False
    """True when execute_model_async returns before the step ends, so the engine can
    schedule step t+1 while step t runs (the workers feed it step t's tokens on the device)."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        return _Done(self.execute_model(scheduler_output))

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None:
        pass


class PendingOutput(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class _Done:
    def __init__(self, output: ModelRunnerOutput):
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output


class UniProcExecutor(Executor):
    """One worker in this process: TP = PP = 1 (CPU tests, one GPU)."""

    supports_overlap = True

    def __init__(self, config: EngineConfig, hf_config, source: ModelSource):
        super().__init__(config, hf_config, source)
        self.worker = Worker(config, hf_config, source)
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        return self.worker.runner.execute_model_async(scheduler_output)


def get_executor_class(config: EngineConfig) -> type[Executor]:
    parallel = config.parallel_config
    backend = parallel.distributed_executor_backend or (
        "uni" if parallel.world_size == 1 else "ray"
    )
    if backend == "uni":
        if parallel.world_size != 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size x "
                f"pipeline_parallel_size = {parallel.world_size} needs 'ray'"
            )
        return UniProcExecutor
    module_name, _, class_name = EXECUTOR_BACKENDS[backend].partition(":")
    return getattr(importlib.import_module(module_name), class_name)
