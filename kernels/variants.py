"""Which Triton kernel variants a process builds, and when.

Triton compiles a kernel once per variant (its constexprs and the specialization of its
arguments), the first time a launch needs it: hundreds of milliseconds on a machine whose
Triton cache is cold, a load from the cache on disk otherwise. The engine builds what
serving needs at start (profile run, CUDA graph capture, warm-up); a variant built later
holds up every request of its step, so the engine warns of each one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)


def _hook(record: Callable[[str], None]) -> Callable[..., bool]:
    """A Triton jit_cache_hook that passes each variant it is told of to `record`."""

    def on_build(*, repr: str, **kwargs) -> bool:
        record(repr)
        return False  # True would skip the build

    return on_build


@contextlib.contextmanager
def new_kernel_variants() -> Iterator[list[str]]:
    """Yields a list that collects each Triton kernel variant built inside the block."""
    from triton import knobs

    built: list[str] = []
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = _hook(built.append)
    try:
        yield built
    finally:
        knobs.runtime.jit_cache_hook = previous


def warn_of_late_kernel_variants() -> None:
    """From now on, log a warning for each Triton kernel variant this process builds."""
    from triton import knobs

    knobs.runtime.jit_cache_hook = _hook(_warn)


def _warn(variant: str) -> None:
    logger.warning(
        "a Triton kernel variant was built while serving; the engine's start did not reach "
        "it, and its step waited for the build: %s",
        variant,
    )
