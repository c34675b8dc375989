"""Garbage-collector pauses of a serving process.

Python's collector stops the process while it runs, and a full collection walks every
object the process holds. After start-up that is torch, transformers, the model's code
and, in a replica, Ray and Serve: hundreds of thousands of objects (bench/RESULTS.md has
the counts and pauses). Serving sets one off now and then, and each stalls every request's
step or stream. `freeze_startup_heap` moves what start-up left out of the collector's reach
(`gc.freeze`), so a later collection walks only what serving allocated since. It is for
processes that serve until they exit, since anything frozen is never collected: the engine
process and a parallel group's workers (Ray Serve freezes its replicas itself once their
__init__ returns).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_threshold_s: float | None = None
"""Collections longer than this are logged; None: not watched yet."""
_collection_started_at: float | None = None


FULL_COLLECTION_EVERY = 100
"""Young-generation collections between full ones in a serving process (Python's default:
10). A full collection walks every request in flight and, in a burst, stalls every stream
while it finds nothing to collect (bench/RESULTS.md). Garbage in reference cycles that lived long enough to reach the oldest
generation waits ten times longer for its collection."""


def freeze_startup_heap() -> None:
    """Collect once, freeze what is left, then `tune_for_serving`."""
    gc.collect()
    gc.freeze()
    tune_for_serving()


def tune_for_serving() -> None:
    """Make full collections rarer and from now on warn of each collection over 50 ms. On
    its own for a process whose heap another freezes (Ray Serve, a replica's)."""
    space_out_full_collections()
    warn_of_slow_collections()


def space_out_full_collections() -> None:
    """A full collection only after FULL_COLLECTION_EVERY young-generation ones."""
    gen0, gen1, _ = gc.get_threshold()
    gc.set_threshold(gen0, gen1, FULL_COLLECTION_EVERY)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside the block, collections skip every object that existed when it began; after it
    they walk them again. For a run in a process that is not only the engine's (an offline
    `LLM.generate`), whose full collections would otherwise walk the whole model. Where a heap is frozen already (a serving process) it changes nothing."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def warn_of_slow_collections(threshold_s: float = 0.05) -> None:
    """Log a warning for each collection of this process that takes over `threshold_s`."""
    global _threshold_s
    if _threshold_s is None:
        gc.callbacks.append(_on_collection)
    _threshold_s = threshold_s


def _on_collection(phase: str, info: dict) -> None:
    global _collection_started_at
    if sys.is_finalizing():  # the collections of the exit; stderr may be closed
        return
    if phase == "start":
        _collection_started_at = time.perf_counter()  # collections do not nest
    elif _collection_started_at is not None:
        pause = time.perf_counter() - _collection_started_at
        _collection_started_at = None
        if _threshold_s is not None and pause > _threshold_s:
            # The pid tells an engine process from the replica that started it: both
            # write to the replica's log.
            logger.warning(
                "a garbage collection (generation %d, %d objects collected) paused this "
                "process (pid %d) for %.0f ms",
                info["generation"],
                info["collected"],
                os.getpid(),
                pause * 1e3,
            )
