"""Executor: drives the workers of one engine. The in-process one serves a single rank.

Executors of several ranks live outside the engine (a Ray actor group, say): whoever builds
the engine passes the class in `distributed_executor_backend`, or a name that an installed
package registers under the `kvray.executors` entry-point group (kvray's own pyproject
registers "ray"). The engine thus never imports Ray nor knows who starts its workers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from importlib.metadata import entry_points
from typing import Protocol

from engine.config import EngineConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.worker.loader import ModelSource
from engine.worker.worker import Worker


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

    def kv_swap_info(self) -> list[dict[str, float]]:
        """Each rank's CPU pool after initialize_cache (Worker.kv_swap_info), rank order;
        [] without swap_space. An executor that does not ask its ranks has no swap."""
        return []

    @property
    def max_concurrent_batches(self) -> int:
        """Steps that may be in flight at once: one per pipeline stage, so that while one
        batch is in stage 2 the next runs in stage 1."""
        return 1

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future:
        """Start a step; the future's result() is its ModelRunnerOutput. Steps run on every
        rank in submission order, so up to `max_concurrent_batches` may be pending; the
        scheduler must not schedule a request again while its sampled token is pending."""
        future: Future = Future()
        try:
            future.set_result(self.execute_model(scheduler_output))
        except Exception as e:
            future.set_exception(e)
        return future

    supports_overlap = False
    """True when execute_model_async returns before the step ends and the workers feed a
    decode its previous token from their own device-side samples, so the engine can schedule
    step t+1 before it has read step t's tokens."""

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def warn_of_late_kernel_variants(self) -> None:
        """From now on every rank warns of each Triton kernel it builds (engine/worker/worker.py)."""

    def freeze_worker_heaps(self) -> None:
        """Every rank that runs in a process of its own freezes its start-up heap
        (engine/observability/gc_pauses.py); the engine's own process is left to whoever owns it."""

    def collective_rpc(self, method: str, *args) -> list:
        """Call `Worker.<method>(*args)` on every rank, in rank order; raises the first
        rank's error. The model lifecycle (engine/lifecycle.py) runs through it."""
        raise NotImplementedError(f"{type(self).__name__} cannot call its workers' methods")

    def step_weight_bytes(self) -> int:
        """Weight bytes one decode step streams on its critical path: the largest
        tensor-parallel shard of each pipeline stage, summed over stages."""
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class PendingOutput(Protocol):
    """A launched step (a Future, or the runner's pending output)."""

    def result(self) -> ModelRunnerOutput: ...


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

    def kv_swap_info(self) -> list[dict[str, float]]:
        info = self.worker.kv_swap_info()
        return [] if info is None else [info]

    def step_weight_bytes(self) -> int:
        return self.worker.weight_bytes()

    def collective_rpc(self, method: str, *args) -> list:
        return [getattr(self.worker, method)(*args)]

    def warn_of_late_kernel_variants(self) -> None:
        self.worker.warn_of_late_kernel_variants()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        return self.worker.execute_model_async(scheduler_output)


EXECUTOR_ENTRY_POINTS = "kvray.executors"
"""Entry-point group of executor classes, by backend name (pyproject.toml registers "ray")."""

DEFAULT_MULTI_RANK_BACKEND = "ray"
"""The backend a group of several ranks runs on when none is named (vLLM's default too)."""


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor `distributed_executor_backend` names: a class as given, a registered
    backend name, else the in-process one for a single rank and the default backend
    (DEFAULT_MULTI_RANK_BACKEND) for several. ValueError naming the setting otherwise."""
    parallel = config.parallel_config
    backend = parallel.distributed_executor_backend
    if backend is None:
        backend = "uni" if parallel.world_size == 1 else DEFAULT_MULTI_RANK_BACKEND
    if isinstance(backend, str) and backend != "uni":
        backend = _registered_executor(backend)
    if isinstance(backend, type):
        if not issubclass(backend, Executor):
            raise ValueError(
                f"distributed_executor_backend={backend.__qualname__} is not a subclass of "
                "engine.executor.Executor"
            )
        return backend
    if parallel.world_size == 1:
        return UniProcExecutor
    raise ValueError(
        f"tensor_parallel_size x pipeline_parallel_size = {parallel.world_size} ranks need an "
        "executor that starts a worker per rank, and 'uni' runs one rank: pass a backend "
        f"name ({', '.join(_registered_names()) or 'none is installed'}) or an Executor class "
        "as distributed_executor_backend"
    )


def _registered_names() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=EXECUTOR_ENTRY_POINTS))


def _registered_executor(name: str) -> type:
    found = [ep for ep in entry_points(group=EXECUTOR_ENTRY_POINTS) if ep.name == name]
    if not found:
        known = ", ".join(["uni", *_registered_names()])
        raise ValueError(
            f"distributed_executor_backend={name!r} is not an installed executor backend "
            f"(known: {known})"
        )
    return found[0].load()
