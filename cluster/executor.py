"""RayActorGroupExecutor: one `RayWorker` actor per rank (cluster/ray_worker.py), placed in
the replica's placement group.

Ranks follow engine.distributed: rank = pp_rank * tp_size + tp_rank, bundle index = rank.
Every step the scheduler output goes to every rank; all ranks run their part of the model
(torch.distributed carries the tensor-parallel all-reduces and the stage-to-stage hand-off)
and the last stage's tensor-parallel rank 0 returns the sampled tokens.

On CUDA the per-step fan-out is a Ray Compiled Graph (InputNode -> every
worker.execute_model -> MultiOutputNode). On CPU it is plain actor calls: a compiled
graph's idle readers poll their channels, and with several ranks on a small machine that
polling takes the cores the ranks compute on.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import ray
from ray.exceptions import RayActorError, RayChannelError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.placement import RankPlacement, place_ranks
from cluster.ray_worker import RayWorker, worker_runtime_env
from engine.config import EngineConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.distributed import check_parallel_sizes
from engine.executor import Executor
from engine.worker.loader import ModelSource

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0
INIT_TIMEOUT_S = 600.0


class WorkerDiedError(RuntimeError):
    """A rank of the actor group is gone; the group cannot run another step."""


class _PendingStep(Future):
    """A step in flight. Its output comes with the workers' answer to the next call
    (`refs`), so result() sends an empty call first when no step followed it."""

    def __init__(self, executor: RayActorGroupExecutor):
        super().__init__()
        self._executor = executor
        self.refs: list[Any] | None = None

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if not self.done():
            try:
                if self.refs is None:
                    self._executor._call_workers(None)
                self.set_result(self._executor._collect(self.refs))
            except Exception as e:
                self.set_exception(e)
        return super().result(timeout)


class RayActorGroupExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        hf_config: Any,
        source: ModelSource,
        use_compiled_graph: bool | None = None,
    ):
        """`use_compiled_graph` None: a compiled graph on CUDA, plain actor calls on CPU."""
        super().__init__(config, hf_config, source)
        parallel = config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        self.pp_size = parallel.pipeline_parallel_size
        self.world_size = parallel.world_size
        check_parallel_sizes(hf_config, self.tp_size, self.pp_size)
        if use_compiled_graph is None:
            use_compiled_graph = config.device == "cuda"
        self.use_compiled_graph = use_compiled_graph
        # The rank that samples: tensor-parallel rank 0 of the last pipeline stage.
        self.driver_rank = (self.pp_size - 1) * self.tp_size
        self.workers: list[Any] = []
        self.placement: RankPlacement | None = None
        self._dag = None
        self._dead: WorkerDiedError | None = None
        self._unanswered: _PendingStep | None = None
        self._unread: list[list[Any]] = []
        if not ray.is_initialized():
            ray.init()
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        cuda = self.config.device == "cuda"
        self.placement = place_ranks(self.world_size, self.pp_size, self.config.device)
        for rank, bundle in enumerate(self.placement.bundles):
            # The bundle reserves the resources; the actor claims only the GPU, so it also
            # fits in bundle 0 beside a Serve replica that holds that bundle's CPUs.
            threads = max(1, int(bundle.get("CPU", 1.0)))
            worker = RayWorker.options(
                num_cpus=0,
                num_gpus=1 if cuda else 0,
                runtime_env=worker_runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement.placement_group, placement_group_bundle_index=rank
                ),
            ).remote(threads)
            self.workers.append(worker)
        self.node_infos: list[dict[str, Any]] = self._get(
            [w.node_info.remote() for w in self.workers], INIT_TIMEOUT_S
        )
        master_ip = self.node_infos[0]["ip"]
        port = self._get([self.workers[0].free_port.remote()], INIT_TIMEOUT_S)[0]
        init_method = f"tcp://{master_ip}:{port}"
        group_devices = self._tensor_parallel_group_devices()
        self._get(
            [
                w.init_worker.remote(
                    self.config, self.hf_config, self.source, rank, init_method, group_devices[rank]
                )
                for rank, w in enumerate(self.workers)
            ],
            INIT_TIMEOUT_S,
        )
        if self.use_compiled_graph:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as scheduler_output:
                dag = MultiOutputNode(
                    [w.execute_model.bind(scheduler_output) for w in self.workers]
                )
            self._dag = dag.experimental_compile(_max_inflight_executions=self.pp_size + 3)

    def _tensor_parallel_group_devices(self) -> list[str | None]:
        """Per rank: its tensor-parallel group's GPUs in rank order when the whole group is
        on one node with one GPU each, else None."""
        out: list[str | None] = [None] * self.world_size
        if self.config.device != "cuda" or self.tp_size == 1:
            return out
        for first in range(0, self.world_size, self.tp_size):
            infos = self.node_infos[first : first + self.tp_size]
            devices = [info["cuda_visible_devices"] for info in infos]
            one_node = len({info["node_id"] for info in infos}) == 1
            if one_node and all(d and "," not in d for d in devices):
                out[first : first + self.tp_size] = [",".join(devices)] * self.tp_size
        return out

    @property
    def node_ids(self) -> list[str]:
        """The Ray node of each rank, in rank order."""
        return [info["node_id"] for info in self.node_infos]

    @property
    def worker_pids(self) -> list[int]:
        return [info["pid"] for info in self.node_infos]

    def _get(self, refs: list[Any], timeout: float | None = None) -> list[Any]:
        """ray.get that fails as soon as any one call fails, instead of after all finish
        (ranks blocked in a collective with a dead peer may take long to notice)."""
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
                if not ready:
                    raise TimeoutError(f"workers did not answer within {timeout} s")
                ray.get(ready)
            return ray.get(refs)
        except RayActorError as e:
            self._dead = WorkerDiedError(f"a worker of the actor group died: {e}")
            raise self._dead from e
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, Exception) else e
            # A rank's collective fails when a peer dies, often before Ray reports the death.
            if self._a_worker_is_gone():
                self._dead = WorkerDiedError(f"a worker of the actor group died ({cause})")
                raise self._dead from e
            # Otherwise a worker raised: hand its own exception (e.g. a ValueError) on.
            raise cause from None

    def _a_worker_is_gone(self) -> bool:
        try:
            ray.get([w.ping.remote() for w in self.workers], timeout=HEALTH_TIMEOUT_S)
        except Exception:
            return True
        return False

    def determine_num_blocks(self) -> int:
        return min(self._get([w.determine_num_blocks.remote() for w in self.workers]))

    def initialize_cache(self, num_blocks: int) -> None:
        self._get([w.initialize_cache.remote(num_blocks) for w in self.workers])

    def kv_swap_info(self) -> list[dict[str, float]]:
        infos = self._get([w.kv_swap_info.remote() for w in self.workers])
        return [info for info in infos if info is not None]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._submit(scheduler_output).result()

    @property
    def max_concurrent_batches(self) -> int:
        return self.pp_size

    @property
    def supports_overlap(self) -> bool:
        """Tensor-parallel ranks share the driver's samples on the device (ModelRunner.
        shares_samples); pipeline stages instead keep one batch per stage in flight."""
        return self.pp_size == 1

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future:
        """Every rank's actor runs its calls in submission order, and stage-to-stage sends
        pair up in that order, so batches queue through the pipeline stage by stage."""
        return self._submit(scheduler_output)

    def _submit(self, scheduler_output: SchedulerOutput) -> _PendingStep:
        self._call_workers(scheduler_output)
        self._unanswered = _PendingStep(self)
        return self._unanswered

    def _call_workers(self, scheduler_output: SchedulerOutput | None) -> None:
        """One call to every rank: it launches `scheduler_output` (None: nothing) and
        answers with the step launched by the call before."""
        if self._dead is not None:
            raise self._dead
        if self._dag is not None:
            try:
                refs = self._dag.execute(scheduler_output)
            except (RayActorError, RayChannelError) as e:
                self._dead = WorkerDiedError(f"a worker of the actor group died: {e}")
                raise self._dead from e
        else:
            arg = None if scheduler_output is None else ray.put(scheduler_output)
            refs = [w.execute_model.remote(arg) for w in self.workers]
        if self._unanswered is not None:
            self._unanswered.refs = refs
            self._unanswered = None
        else:
            # Answers no step; read before any later answer (a compiled graph holds every
            # unread result).
            self._unread.append(refs)

    def _collect(self, refs: list[Any]) -> ModelRunnerOutput:
        while self._unread:
            self._get_answers(self._unread.pop(0))
        return self._get_answers(refs)[self.driver_rank]

    def _get_answers(self, refs: list[Any]) -> list[Any]:
        if self._dag is None:
            return self._get(refs)
        try:
            return ray.get(refs)
        except (RayActorError, RayChannelError) as e:
            self._dead = WorkerDiedError(f"a worker of the actor group died: {e}")
            raise self._dead from e

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        self._get([w.ping.remote() for w in self.workers], HEALTH_TIMEOUT_S)

    def warn_of_late_kernel_variants(self) -> None:
        self._get([w.warn_of_late_kernel_variants.remote() for w in self.workers])

    def freeze_worker_heaps(self) -> None:
        self._get([w.freeze_startup_heap.remote() for w in self.workers])

    def collective_rpc(self, method: str, *args: Any) -> list:
        return self._get([w.collective_rpc.remote(method, *args) for w in self.workers])

    def step_weight_bytes(self) -> int:
        sizes = self._get([w.weight_bytes.remote() for w in self.workers])
        tp = self.tp_size
        return sum(max(sizes[stage * tp : (stage + 1) * tp]) for stage in range(self.pp_size))

    def shutdown(self) -> None:
        """Stop every rank and give the placement back; safe to call more than once."""
        if self._dag is not None:
            try:
                self._dag.teardown()
            except Exception:
                logger.debug("compiled graph teardown failed", exc_info=True)
            self._dag = None
        if self.workers and self._dead is None:
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=10)
            except Exception:
                logger.debug("worker shutdown failed", exc_info=True)
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:
                pass
        self.workers = []
        if self.placement is not None:
            self.placement.release()
            self.placement = None

    def __del__(self) -> None:
        if getattr(self, "workers", None) and ray.is_initialized():
            self.shutdown()
