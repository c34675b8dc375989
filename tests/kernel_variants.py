"""A probe for tests that no Triton kernel variant is first needed while serving."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def new_kernel_variants() -> Iterator[list[str]]:
    """Yields a list that collects each Triton kernel variant (kernel and specialization)
    this process had not run before, as it is first launched inside the block: each is a
    compile (on a machine whose Triton cache is cold, hundreds of milliseconds) or a load
    from the cache on disk."""
    from triton import knobs

    seen: list[str] = []
    previous = knobs.runtime.jit_cache_hook

    def hook(*, repr: str, **kwargs) -> bool:
        seen.append(repr)
        return False  # True would skip the compile

    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = previous
