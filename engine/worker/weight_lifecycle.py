"""One rank's side of the model lifecycle: weights replaced in place, sleep and wake, and the
weight cache (engine/worker/weight_cache.py).

A weights-only switch runs in two phases on every rank, so that a failure on one leaves all
of them serving the old weights: `stage` loads the new checkpoint into staging memory (the
host for 16-bit models, the device for quantized ones, whose loading turns checkpoint tensors
into kernel layouts on the device) through the model's own weight loaders, which check every
tensor's name and shape; then `commit` copies it into the live tensors in place, so that the
CUDA graphs captured over them stay valid.

Sleep level 1 keeps a host copy of the weights (the weight cache's entry when it fits) and
frees them and the KV cache on the device; level 2 keeps no copy (wake-up takes the weight
cache's entry if there is one, else reads the checkpoint). Wake-up allocates both again, at
the same sizes but new addresses, so it captures the CUDA graphs again.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.distributed import get_pp_rank, get_pp_size, get_tp_rank, get_tp_size
from engine.layers.quantization import build_quant_config
from engine.worker.loader import ModelSource, build_model, load_hf_config, load_model
from engine.worker.weight_cache import (
    WeightKey,
    checkpoint_fingerprint,
    process_weight_cache,
    release_pinned_memory,
)
from engine.worker.weight_tensors import (
    TensorSpec,
    check_same_shapes,
    copy_into,
    host_copy,
    reallocate,
    release,
    tensors_bytes,
    weight_tensors,
)

logger = logging.getLogger(__name__)


@dataclass
class _Staged:
    source: ModelSource
    key: WeightKey
    tensors: dict[str, torch.Tensor]
    from_cache: bool


class WeightLifecycle:
    """Held by a ModelRunner (`runner.weights`); `runner.model` is the live model."""

    def __init__(self, runner: Any):
        self.runner = runner
        config = runner.config
        self.cache = process_weight_cache(config.cache_config.weight_cache_gb)
        self.pin = runner.device.type == "cuda"
        self.source: ModelSource | None = None
        self.sleep_level = 0
        self._staged: _Staged | None = None
        self._host_copy: dict[str, torch.Tensor] | None = None
        self._specs: dict[str, TensorSpec] | None = None
        self._num_blocks = 0

    def key(self, source: ModelSource) -> WeightKey:
        model = self.runner.config.model
        return WeightKey(
            kind=source.kind,
            path=source.path,
            fingerprint=checkpoint_fingerprint(source, model.seed),
            dtype=str(self.runner.dtype),
            quantization=model.quantization,
            layout=(get_tp_rank(), get_tp_size(), get_pp_rank(), get_pp_size()),
        )

    @property
    def quantized(self) -> bool:
        return self.runner.config.model.quantization != "none"

    @property
    def _staging_device(self) -> torch.device:
        """Where a checkpoint is read before it replaces the live weights: the host for a
        16-bit model; the device for a quantized one (its loading makes device layouts)."""
        return self.runner.device if self.quantized else torch.device("cpu")

    def _quant_config(self, source: ModelSource, device: torch.device):
        runner = self.runner
        method = runner.config.model.quantization
        return build_quant_config(method, runner.hf_config, source.path, device)

    def _read_checkpoint(self, source: ModelSource, device: torch.device):
        """A model of `source` built and filled on `device`: every tensor read and checked."""
        runner = self.runner
        return load_model(
            source,
            runner.hf_config,
            runner.dtype,
            device,
            seed=runner.config.model.seed,
            max_model_len=runner.config.scheduler_config.max_model_len,
            quant_config=self._quant_config(source, device),
        )

    # -- the engine's first load ----------------------------------------------------------

    def load(self, source: ModelSource) -> torch.nn.Module:
        """The live model of `source`: a 16-bit one from the weight cache when it holds it
        (a model rebuilt for a switch back), else read from the checkpoint."""
        self.source = source
        runner = self.runner
        # A quantized model's entry holds its tensors after loading turned them into kernel
        # layouts: a freshly built model has the checkpoint's layout, so it reads the file.
        cached = None if self.quantized else self.cache.get(self.key(source))
        if cached is None:
            return self._read_checkpoint(source, runner.device)
        start = time.perf_counter()
        model = build_model(
            runner.hf_config,
            runner.dtype,
            runner.device,
            runner.config.scheduler_config.max_model_len,
        )
        copy_into(weight_tensors(model), cached)
        logger.info(
            "%s: weights from the weight cache in %.2f s", source.path, time.perf_counter() - start
        )
        return model.eval()

    # -- a weights-only switch -------------------------------------------------------------

    def stage(self, source: ModelSource) -> None:
        """Read `source`'s weights into staging memory and check them against the live
        model's; the live model is untouched. ValueError naming the first tensor that does
        not fit, FileNotFoundError for missing files."""
        self._check_awake("load_model")
        self._staged = None
        new_config = load_hf_config(source)
        old_arch = getattr(self.runner.hf_config, "architectures", None)
        new_arch = getattr(new_config, "architectures", None)
        if old_arch and new_arch and list(old_arch) != list(new_arch):
            raise ValueError(
                f"weights_only=True keeps the architecture: {source.path} is {new_arch}, the "
                f"model is {old_arch}; load it without weights_only"
            )
        key = self.key(source)
        cached = self.cache.get(key)
        if cached is not None:
            tensors = cached
        else:
            tensors = weight_tensors(self._read_checkpoint(source, self._staging_device))
        check_same_shapes(weight_tensors(self.runner.model), tensors)
        self._staged = _Staged(source, key, tensors, from_cache=cached is not None)

    def commit(self) -> None:
        """Copy the staged weights into the live tensors (the old ones kept in the weight
        cache first, when they fit)."""
        staged, self._staged = self._staged, None
        if staged is None:
            raise RuntimeError("no staged weights to commit: stage() first")
        self.keep_in_cache()
        tensors = staged.tensors
        if not staged.from_cache and self.cache.fits(tensors_bytes(tensors)):
            # Host staging on a CPU is the entry as it is; on a GPU the entry is pinned, and
            # the copy to the device then runs from pinned memory, at full speed.
            tensors = host_copy(tensors, True) if self.pin else tensors
            self.cache.put(staged.key, tensors)
        copy_into(weight_tensors(self.runner.model), tensors)
        self.source = staged.source

    def discard(self) -> None:
        self._staged = None

    def keep_in_cache(self) -> None:
        """Put the live weights in the weight cache unless it has them or they do not fit."""
        key = self.key(self.source)
        live = weight_tensors(self.runner.model)
        if key not in self.cache and self.cache.fits(tensors_bytes(live)):
            self.cache.put(key, host_copy(live, self.pin))

    # -- sleep and wake --------------------------------------------------------------------

    def _check_awake(self, what: str) -> None:
        if self.sleep_level:
            raise RuntimeError(
                f"the engine is asleep (level {self.sleep_level}): call wake_up() before {what}"
            )

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self._check_awake("sleep")
        live = weight_tensors(self.runner.model)
        if level == 1:
            key = self.key(self.source)
            host = self.cache.get(key)
            if host is None:
                # On a CPU the live tensors' storage is the host copy: release() below only
                # hands the parameters new, empty storage.
                on_host = self.runner.device.type == "cpu"
                host = (
                    {n: t.detach() for n, t in live.items()} if on_host else host_copy(live, True)
                )
                self.cache.put(key, host)
            self._host_copy = host
        self._num_blocks = self.runner.free_kv_cache()
        self._specs = release(live)
        self.sleep_level = level
        empty_device_cache(self.runner.device)
        release_pinned_memory()  # the KV swap pool's

    def wake_up(self) -> None:
        if not self.sleep_level:
            return
        host = self._host_copy or self.cache.get(self.key(self.source))
        if host is None:  # level 2 without a cached copy: the checkpoint again
            host = weight_tensors(self._read_checkpoint(self.source, self._staging_device))
        live = weight_tensors(self.runner.model)
        reallocate(live, self._specs)
        copy_into(live, host)
        self._host_copy = self._specs = None
        del host
        release_pinned_memory()  # a host copy the cache does not keep
        self.runner.init_kv_cache(self._num_blocks)
        self.sleep_level = 0

    def release_memory(self) -> None:
        """Drop the model, its KV cache and graphs (the engine is torn down for another)."""
        self.runner.free_kv_cache()
        self.runner.model = None
        self._host_copy = self._staged = None
        empty_device_cache(self.runner.device)


def empty_device_cache(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
