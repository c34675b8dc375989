"""The colocated ingress's engine: an `EngineHost` in the ingress's own process behind the
part of an LLMServer handle the ingress uses (`LocalServer`), so the ingress code is the
same with or without a Ray call between HTTP and the engine."""

from __future__ import annotations

import asyncio
import inspect
from typing import TYPE_CHECKING, Any

from ray.serve.exceptions import BackPressureError

from cluster.app_config import AppConfig

if TYPE_CHECKING:
    from cluster.engine_host import EngineHost


class _LocalReplies:
    """An async generator of the local EngineHost, with a handle response's cancel();
    `on_end` runs once when it ends, however it ends."""

    def __init__(self, replies: Any, on_end: Any = None):
        self._replies = replies
        self._on_end = on_end
        self._closing: asyncio.Task | None = None

    def __aiter__(self) -> _LocalReplies:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._replies.__anext__()
        except BaseException:
            self._end()
            raise

    def _end(self) -> None:
        if self._on_end is not None:
            self._on_end()
            self._on_end = None

    def cancel(self) -> None:
        self._end()
        closing = asyncio.get_running_loop().create_task(self._replies.aclose())
        # A generator that already ended or is still running in its caller's task: nothing
        # to close here (the caller's cancellation or exit closes it).
        closing.add_done_callback(lambda task: task.cancelled() or task.exception())
        self._closing = closing  # the event loop keeps only a weak reference to its tasks


class _Rejected:
    """A reply that raises BackPressureError at once, as a full handle's does."""

    def __init__(self, error: BackPressureError):
        self._error = error

    def __aiter__(self) -> _Rejected:
        return self

    async def __anext__(self) -> Any:
        raise self._error

    def cancel(self) -> None:
        pass


async def _ready(value: Any) -> Any:
    return value


def colocated_capacity(config: AppConfig) -> int:
    """Requests one colocated replica holds (running or waiting) before it answers 429."""
    return config.resolved_max_ongoing_requests() + config.resolved_max_queued_requests()


class LocalServer:
    """An EngineHost in this process behind the part of LLMServer's handle the ingress
    uses: `.options(...)`, `.method.remote(...)`, awaitable or async-iterable replies.

    Serve's own queue bound would answer an overload before the ingress code runs (plain
    text); here `generate` admits at most `max_requests` at once and refuses more with the
    handle's BackPressureError, which the ingress turns into OpenAI's 429.
    """

    def __init__(self, host: EngineHost, max_requests: int):
        self.host = host
        self.max_requests = max_requests
        self.active = 0

    def options(self, **_: Any) -> LocalServer:
        return self

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(self, name)

    def _finished(self) -> None:
        self.active -= 1


class _LocalMethod:
    def __init__(self, server: LocalServer, name: str):
        self._server = server
        self._method = getattr(server.host, name)

    def remote(self, *args: Any) -> Any:
        server = self._server
        if inspect.isasyncgenfunction(self._method):
            if server.active >= server.max_requests:
                return _Rejected(BackPressureError(server.active, server.max_requests, 429))
            server.active += 1
            return _LocalReplies(self._method(*args), on_end=server._finished)
        result = self._method(*args)
        return result if inspect.isawaitable(result) else _ready(result)
