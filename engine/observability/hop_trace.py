"""Timestamps of a request's hops through the processes that serve it (bench/hops.py joins
them): where the time to its first token goes, client, replica and engine process alike.

Off unless the switch `kvray_env.HOP_TRACE` names a folder when a process starts (Ray's
workers and the engine process inherit it from the environment Ray was started in). Each
process then appends `label pid nanoseconds` lines to `<folder>/<pid>.log`, the time from
CLOCK_MONOTONIC, which every process of a machine shares, so the lines of a client, a
replica and its engine process line up. A write costs a few microseconds; off, `hop` is a
test of one global.
"""

from __future__ import annotations

import logging
import os
import time

import kvray_env

logger = logging.getLogger(__name__)

_folder: str | None = kvray_env.hop_trace_folder()
_fd: int | None = None


def enabled() -> bool:
    return _folder is not None


def start(folder: str | None) -> None:
    """Trace this process into `folder` from now on, or stop with None (tests; processes
    started afterwards still follow the environment)."""
    global _folder, _fd
    _folder, _fd = folder, None


def hop(label: str) -> None:
    global _folder, _fd
    if _folder is None:
        return
    try:
        if _fd is None:
            os.makedirs(_folder, exist_ok=True)
            path = os.path.join(_folder, f"{os.getpid()}.log")
            _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(_fd, f"{label} {os.getpid()} {time.monotonic_ns()}\n".encode())
    except OSError as e:
        # A diagnostic never fails a request: say so once and stop tracing.
        logger.warning("hop traces stop: %s", e)
        _folder = None
