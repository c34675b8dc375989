"""Other names that serving guides give kvray's keys, in one table.

Every entry point applies `resolve_aliases` to the keys it is given: `EngineArgs(...)` (and so
`LLM(...)` and `AsyncEngine`), a Serve app's keys and each entry of its `models`, and the
`kvray serve` flags (`--request-timeout 300`). An alias is renamed to the key it stands for
where that key belongs to the entry point; an alias with no kvray equivalent is refused with a
message that names what to use. docs/configuration.md lists the table.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Alias:
    key: str | None
    """The key the alias stands for; None: refused (kvray has no such setting)."""
    note: str
    """What the alias means here (for a refused alias: why, and what to use)."""
    kvray_behaviour: bool | None = None
    """For a refused alias: the value that only asks for what kvray does anyway, accepted
    (and dropped) so that a guide's command runs as written; any other value is refused."""
    scale: float | None = None
    """The key's value for an alias value of 1 where the two differ in unit (seconds ->
    ms: 1000); None: the value as given."""


ALIASES: dict[str, Alias] = {
    "request_timeout": Alias(
        "request_timeout_s",
        "vLLM's spelling (--request-timeout): seconds a request may run before it is "
        "aborted with a 408",
    ),
    "max_batch_size": Alias(
        "max_num_seqs",
        "the most sequences one step batches (the batching guides' batch size)",
    ),
    "max_num_batches": Alias(
        None,
        "kvray keeps one batch in flight per pipeline stage (pipeline_parallel_size) and "
        "has no setting of its own for it: set max_num_seqs for a batch's size, "
        "pipeline_parallel_size for the batches in flight",
    ),
    "batch_timeout": Alias(
        "batch_wait_timeout_ms",
        "in seconds, as the guides write it (0.05: 50 ms, for interactive use): how long "
        "new requests may wait for more arrivals to join their prefill step",
        scale=1000,
    ),
    "skip_special_tokens": Alias(
        None,
        "a field of each request (SamplingParams, and the API's request body), true unless "
        "the request says otherwise; the switch (true) is what every request does already "
        "and is accepted; there is no server-wide false: set it per request",
        kvray_behaviour=True,
    ),
}


def resolve_aliases(args: dict[str, Any], keys: Collection[str]) -> dict[str, Any]:
    """`args` with each alias of one of `keys` renamed to its key.

    ValueError for an alias kvray refuses, and for an alias given beside the key it stands
    for (naming both). Aliases of keys outside `keys` stay as given, for the entry point to
    refuse as unknown.
    """
    resolved = dict(args)
    for alias, entry in ALIASES.items():
        if alias not in args:
            continue
        if entry.key is None:
            if entry.kvray_behaviour is not None and _as_bool(args[alias]) is entry.kvray_behaviour:
                del resolved[alias]
                continue
            raise ValueError(f"{alias}: {entry.note}")
        if entry.key not in keys:
            continue
        if entry.key in args:
            raise ValueError(
                f"{alias} is another name for {entry.key}: give {entry.key} or {alias}, not both"
            )
        value = resolved.pop(alias)
        resolved[entry.key] = value if entry.scale is None else _scaled(alias, value, entry.scale)
    return resolved


def _scaled(alias: str, value: Any, scale: float) -> float:
    """A number (or its text, from a flag) times `scale`; ValueError naming the alias."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if isinstance(value, bool) or number is None or not math.isfinite(number):
        raise ValueError(f"{alias} must be a finite number, got {value!r}")
    return number * scale


def _as_bool(value: Any) -> bool | None:
    """A flag's or a key's boolean (True, "true", "1", ...); None when it is none."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    return None
