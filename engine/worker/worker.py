"""One rank: its device, its shard of the model, its KV tensors and a ModelRunner."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.distributed import init_sequence_parallel, init_symmetric_all_reduce
from engine.observability.step_profiler import StepProfiler
from engine.worker.loader import ModelSource
from engine.worker.model_runner import ModelRunner, PendingRunnerOutput

LIFECYCLE_METHODS = (
    "stage",
    "commit",
    "discard",
    "keep_in_cache",
    "sleep",
    "wake_up",
    "release_memory",
)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        source: ModelSource,
        rank: int = 0,
        local_rank: int = 0,
    ):
        self.config = config
        self.rank = rank
        if config.device == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            init_symmetric_all_reduce(self.device)
        else:
            self.device = torch.device("cpu")
        init_sequence_parallel(config.parallel_config.sequence_parallel_min_tokens)
        self.runner = ModelRunner(config, hf_config, self.device)
        self.source = source
        self.profiler = StepProfiler.from_env(rank)

    def load_model(self) -> None:
        self._use_device()
        self.runner.load_model(self.source)

    def determine_num_blocks(self) -> int:
        self._use_device()
        return self.runner.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self._use_device()
        self.runner.init_kv_cache(num_blocks)

    def kv_swap_info(self) -> dict[str, float] | None:
        """This rank's CPU pool for the scheduler (engine/worker/kv_swap.py); None without."""
        self._use_device()
        return self.runner.kv_swap_info()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingRunnerOutput:
        """Launch the step; result() waits for its output."""
        self._use_device()
        if self.profiler is None:
            return self.runner.execute_model_async(scheduler_output)
        self.profiler.before_step()
        try:
            return self.runner.execute_model_async(scheduler_output)
        finally:
            self.profiler.after_step()

    def lifecycle(self, method: str, *args) -> None:
        """Run one of the model lifecycle's steps on this rank (engine/worker/weight_lifecycle.py:
        stage, commit, discard, keep_in_cache, sleep, wake_up, release_memory); the executor
        calls it on every rank (Executor.collective_rpc)."""
        if method not in LIFECYCLE_METHODS:
            raise ValueError(
                f"method must be one of {', '.join(LIFECYCLE_METHODS)}, got {method!r}"
            )
        self._use_device()
        getattr(self.runner.weights, method)(*args)
        if method == "commit":
            self.source = self.runner.weights.source

    def _use_device(self) -> None:
        # The current CUDA device is per thread, and a caller may reach this rank from
        # another thread than the one that built it (a Ray compiled graph's loop does);
        # with several GPUs visible, kernels would launch on the wrong one.
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)

    def warn_of_late_kernel_variants(self) -> None:
        """Log each Triton kernel variant this process builds from now on (the engine calls
        it on a GPU once its warm-up is done)."""
        from kernels.variants import warn_of_late_kernel_variants

        warn_of_late_kernel_variants()

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (tied weights counted once)."""
        seen: set[int] = set()
        total = 0
        for p in self.runner.model.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total
