"""The model lifecycle of an engine, without a restart: another model's weights loaded in
place or another model loaded whole, sleep and wake, the prefix cache reset.

Mixed into LLMEngine. Every step runs on all ranks through `Executor.collective_rpc`
(each rank's part: engine/worker/weight_lifecycle.py), and only while no request is in flight.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from engine.arg_aliases import resolve_aliases
from engine.config import EngineArgs, UsageContext
from engine.executor import UniProcExecutor
from engine.input_processor import load_tokenizer_for
from engine.models.registry import architectures_of, get_model_class
from engine.worker.loader import (
    ModelSource,
    load_hf_config,
    resolve_model_source,
    safetensors_files,
    served_names,
)

logger = logging.getLogger(__name__)

MODEL_OWN_KEYS = {"tokenizer": None, "served_model_name": None}
"""Engine keys that belong to the model they were given for: a whole switch leaves them
unset unless given again."""


class ModelLifecycle:
    engine_args: EngineArgs | None = None
    """The engine's arguments (from_engine_args sets them): a whole switch keeps all but the
    model's."""
    usage_context: UsageContext = "offline"
    sleep_level: int = 0
    """0 awake; 1 or 2 asleep at that level."""

    def load_model(
        self,
        model: str | None,
        weights_only: bool = False,
        load_format: str = "auto",
        **engine_args: Any,
    ) -> None:
        """Serve `model` (a folder, a .gguf file, or a shape name with load_format="dummy")
        from now on, keeping this engine object. Only with no request in flight (ValueError
        naming how many are). The prefix cache is reset.

        weights_only=True: a checkpoint of the same architecture and shapes replaces the
        weights in place, on every rank: the KV cache and the CUDA graphs stay. The checkpoint
        is read and checked whole first (every tensor through the model's weight loaders),
        so a mismatch (ValueError naming the first tensor and both shapes) or a failed read
        leaves the old weights serving. The tokenizer and the generation defaults stay the
        old model's. A 16-bit model is read into host memory first, a quantized one into
        device memory (room for a second copy of its weights). From the weight cache
        (weight_cache_gb) it is a copy, no read.

        Otherwise any model: the engine is torn down and built again for it (executor,
        workers, KV cache, CUDA graphs, scheduler, tokenizer, generation defaults), with the
        engine's keys but the model's own (load_format, tokenizer, served_model_name) and
        any `engine_args` given. The model is checked to exist and its engine keys to fit
        before anything is torn down; a load that fails later builds the old model again
        and raises the cause. The old weights go to the weight cache first (when it is on and
        they fit); a 16-bit model found there is copied in, not read.
        """
        self._check_idle("load_model")
        start = time.perf_counter()
        if weights_only:
            if engine_args:
                raise ValueError(
                    f"weights_only=True keeps the engine keys: {', '.join(sorted(engine_args))} "
                    "need a whole switch (weights_only=False)"
                )
            self._load_weights(resolve_model_source(model, load_format), load_format)
        else:
            self._switch_engine(model, load_format, engine_args)
        self.reset_prefix_cache()
        logger.info(
            "%s loaded (%s) in %.2f s",
            self.model_name,
            "weights only" if weights_only else "whole engine",
            time.perf_counter() - start,
        )

    def _load_weights(self, source: ModelSource, load_format: str) -> None:
        try:
            self.executor.collective_rpc("lifecycle", "stage", source)
        except BaseException:
            self.executor.collective_rpc("lifecycle", "discard")
            raise
        self.executor.collective_rpc("lifecycle", "commit")
        self.executor.source = source
        model_keys = {"model": source.path, "load_format": load_format}
        self.config = self.config.model_copy(
            update={"model_config_": self.config.model.model_copy(update=model_keys)}
        )
        if self.engine_args is not None:
            self.engine_args = self.engine_args.model_copy(update=model_keys)
        self._name_model()

    def _name_model(self) -> None:
        model = self.config.model
        self.served_model_names = served_names(
            model.served_model_name, model.model, model.load_format
        )
        if self.metrics is not None:  # what the old name did goes out under it
            self.metrics.maybe_flush(self.stats, idle=True)
            self.metrics.labels = {"model": self.served_model_names[0]}
        self.model_name = self.served_model_names[0]

    def _switch_engine(self, model: str | None, load_format: str, engine_args: dict) -> None:
        if self.engine_args is None:
            raise ValueError("this engine was not built from engine arguments (from_engine_args)")
        old_args = self.engine_args
        keys = dict(old_args) | MODEL_OWN_KEYS | {"model": model, "load_format": load_format}
        # Other names (max_batch_size) as their keys first, so that they replace the old value.
        given = resolve_aliases(engine_args, EngineArgs.model_fields)
        args = EngineArgs(**(keys | given))
        self._check_loadable(args)
        executor_class = type(self.executor)
        metrics = self.metrics
        if metrics is not None:
            metrics.maybe_flush(self.stats, idle=True)
        if isinstance(self.executor, UniProcExecutor):
            # Only a rank in this process outlives the executor, and its cache with it.
            self.executor.collective_rpc("lifecycle", "keep_in_cache")
        self._tear_down()
        try:
            self._start(args, executor_class, metrics)
        except BaseException as e:
            logger.error("loading %s failed (%s): the old model loads again", model, e)
            self._start(old_args, executor_class, metrics)
            raise

    def _check_loadable(self, args: EngineArgs) -> None:
        """What can fail before a model loads: its files, its config, its class, its keys."""
        args.check_device_keys()
        source = resolve_model_source(args.model, args.load_format)
        hf_config = load_hf_config(source)
        get_model_class(architectures_of(hf_config))
        resolved = args.model_copy(update={"model": str(source.path)})
        resolved.create_engine_config(hf_config, self.usage_context)
        if source.kind == "hf":
            safetensors_files(Path(source.path))

    def _tear_down(self) -> None:
        self.executor.collective_rpc("lifecycle", "release_memory")
        self.shutdown()

    def _start(self, args: EngineArgs, executor_class: type, metrics: Any) -> None:
        source = resolve_model_source(args.model, args.load_format)
        hf_config = load_hf_config(source)
        resolved = args.model_copy(update={"model": str(source.path)})
        config = resolved.create_engine_config(hf_config, self.usage_context)
        tokenizer = load_tokenizer_for(source, args.tokenizer, args.tokenizer_mode)
        usage_context = self.usage_context
        type(self).__init__(self, config, hf_config, source, tokenizer, executor_class)
        self.engine_args, self.usage_context = args, usage_context
        if metrics is not None:
            self.enable_metrics(metrics.sink, metrics.flush_interval_s)

    # -- sleep and wake --------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the device's memory while idle (vLLM's levels): 1 moves the weights to host
        memory (pinned; the weight cache's entry when it fits) and frees the KV cache; 2
        also drops the weights (wake_up copies them from the weight cache when it holds
        them, else reads the checkpoint). Requests are refused until wake_up()."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self._check_idle("sleep")
        self.executor.collective_rpc("lifecycle", "sleep", level)
        self.reset_prefix_cache()
        self.sleep_level = level

    def wake_up(self) -> None:
        """Weights and KV cache back on the device (the KV cache at its old size, empty);
        the CUDA graphs are captured again (the tensors come back at new addresses)."""
        if not self.sleep_level:
            return
        self.executor.collective_rpc("lifecycle", "wake_up")
        self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return self.sleep_level != 0

    def check_awake(self) -> None:
        """RuntimeError while asleep (add_request calls it)."""
        if self.sleep_level:
            raise RuntimeError(
                f"the engine is asleep (sleep level {self.sleep_level}): call wake_up() first"
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (and the CPU tier's); False, changing nothing, while a
        request holds blocks."""
        if not self.scheduler.kv_cache_manager.reset_prefix_cache():
            return False
        if self.scheduler.offload is not None:
            self.scheduler.offload.reset_prefix_cache()
        return True

    def _check_idle(self, what: str) -> None:
        self.check_awake()
        if self.has_unfinished_requests():
            count = self.get_num_unfinished_requests()
            raise ValueError(
                f"{what} needs an idle engine: {count} request(s) are unfinished; let them "
                "finish or abort them first"
            )
        while self._pending:  # steps launched after the last output (nothing scheduled)
            self._complete(*self._pending.popleft())
