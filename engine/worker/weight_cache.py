"""The weight cache: a bounded pool of host memory (pinned on CUDA) holding recently used
models' weights, one rank's tensors per entry, so that switching back to a model or waking
one is a host-to-device copy instead of a disk read and parse.

One cache per process (each rank runs in a process of its own, or in the engine's), shared by
the engines that process builds in turn: an engine rebuilt for another model finds the old
one's weights here. Its size is the engine key `weight_cache_gb`; 0 keeps nothing.

Entries are keyed by what makes one rank's tensors (`WeightKey`): the checkpoint (its path and
a fingerprint of its files' sizes and mtimes, so that a checkpoint rewritten in place misses),
the dtype, the quantization and the rank's place in the tensor- and pipeline-parallel layout.
Least recently used entries go first when a new one needs room; one larger than the whole
cache is not kept.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.worker.loader import ModelSource

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightKey:
    kind: str
    path: str
    fingerprint: tuple
    dtype: str
    quantization: str
    layout: tuple[int, int, int, int]
    """(tp rank, tp size, pp rank, pp size)."""


def checkpoint_fingerprint(source: ModelSource, seed: int) -> tuple:
    """(name, size, mtime_ns) of each file the weights come from; dummy weights: their seed.
    Reads no tensor."""
    if source.kind == "dummy":
        return ("seed", seed)
    path = Path(source.path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    stats = []
    for file in files:
        if file.suffix in (".safetensors", ".gguf", ".json"):
            st = file.stat()
            stats.append((file.name, st.st_size, st.st_mtime_ns))
    return tuple(stats)


def entry_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class WeightCache:
    def __init__(self, capacity_bytes: int = 0):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[WeightKey, dict[str, torch.Tensor]] = OrderedDict()

    @property
    def used_bytes(self) -> int:
        return sum(entry_bytes(e) for e in self._entries.values())

    def resize(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._evict_for(0)

    def fits(self, num_bytes: int) -> bool:
        return 0 < num_bytes <= self.capacity_bytes

    def get(self, key: WeightKey) -> dict[str, torch.Tensor] | None:
        """The entry (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def __contains__(self, key: WeightKey) -> bool:
        return key in self._entries

    def put(self, key: WeightKey, tensors: dict[str, torch.Tensor]) -> bool:
        """Keep `tensors` (host tensors, taken as they are) under `key`, evicting the least
        recently used entries for room; False when they are larger than the whole cache."""
        size = entry_bytes(tensors)
        self._entries.pop(key, None)
        if not self.fits(size):
            return False
        self._evict_for(size)
        self._entries[key] = tensors
        logger.info(
            "weight cache: kept %s (%.2f GiB; %d entries, %.2f of %.2f GiB)",
            key.path,
            size / 2**30,
            len(self._entries),
            self.used_bytes / 2**30,
            self.capacity_bytes / 2**30,
        )
        return True

    def _evict_for(self, size: int) -> None:
        evicted = False
        while self._entries and self.used_bytes + size > self.capacity_bytes:
            key, _ = self._entries.popitem(last=False)
            logger.info("weight cache: evicted %s", key.path)
            evicted = True
        if evicted:
            release_pinned_memory()


def release_pinned_memory() -> None:
    """Give the pinned pages no tensor holds back to the system: torch's pinned allocator
    keeps freed blocks for reuse, which would keep an evicted entry's memory pinned."""
    if torch.cuda.is_available() and hasattr(torch.accelerator, "empty_host_cache"):
        torch.accelerator.empty_host_cache()

    def clear(self) -> None:
        self._entries.clear()


_PROCESS_CACHE = WeightCache()


def process_weight_cache(capacity_gb: float) -> WeightCache:
    """This process's cache, resized to `capacity_gb` GiB (the engine key weight_cache_gb)."""
    _PROCESS_CACHE.resize(int(capacity_gb * 2**30))
    return _PROCESS_CACHE
