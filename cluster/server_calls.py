"""A generation request's call to its model's server, as the ingress makes it.

What a server sends back (cluster/engine_host.py): first an `APIError`, a whole response
(dict) or the prompt tokens (int: a stream has started), then a stream's SSE text and its
`UsageInfo`. Here the ingress waits for the first reply within the request's time limit
(and the bound while no replica is up, cluster/replica_watch.py), and turns a replica that
died under the request into what a client can act on: a 503 with Retry-After before the
response has started, an SSE error event and `[DONE]` after.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from cluster.replica_watch import ReplicaWatch, cancel_call, no_replica, replica_lost
from engine.api.errors import APIError
from engine.api.responses import UsageInfo

if TYPE_CHECKING:
    from engine.api.serving import RequestContext


@dataclass(frozen=True)
class GenerationReplies:
    """How a front end (HTTP, gRPC) answers a generation request the ingress has run."""

    error: Callable[[APIError], Any]
    """An APIError raised before the answer started (its status, message, Retry-After)."""
    whole: Callable[[dict], Any]
    """A whole response's JSON."""
    stream: Callable[[ServerStream, Callable[[], None]], Any]
    """(the server's stream, on_close): the answer must run on_close once it has ended,
    however it ended: it aborts the server's call if still running and charges the tenant."""


async def first_reply(
    server: Any, watch: ReplicaWatch, kind: str, parsed: Any, ctx: RequestContext
) -> tuple[Any, Any]:
    """Send the request to `server` (the model's streaming handle): (its replies, the first).

    A stream whose replica died before its first output has sent its client nothing: it
    is sent once more (Serve's handle picks a live replica, or waits for one within the
    watch's bound). A request sent whole may have run for a while on the replica that
    died: it is a 503 with Retry-After, and the client decides.
    """
    attempts = 2 if getattr(parsed, "stream", False) else 1
    for attempt in range(attempts):
        replies = server.generate.remote(kind, parsed, ctx)
        try:
            return replies, await _await_first(replies, watch, ctx)
        except RayActorError as e:
            cancel_call(replies)
            watch.saw_loss()
            if attempt + 1 == attempts:
                raise replica_lost(watch.model, e) from None
    raise AssertionError("unreachable")


async def _await_first(replies: Any, watch: ReplicaWatch, ctx: RequestContext) -> Any:
    remaining = None if ctx.deadline is None else max(0.0, ctx.deadline - time.time())
    bounded_by_watch = False
    try:
        async with asyncio.timeout(remaining) as limit:
            watch.awaiting_first_reply(limit)
            try:
                first = await replies.__anext__()
            finally:
                bounded_by_watch = watch.first_reply_done(limit)
    except BackPressureError:
        # Never assigned to a replica: nothing to cancel (cancel() would raise it again).
        raise APIError(
            "the server is at capacity (max_queued_requests): retry shortly",
            429,
            code="server_overloaded",
            retry_after_s=1,
        ) from None
    except TimeoutError:
        cancel_call(replies)
        if bounded_by_watch:
            raise no_replica(watch.model) from None  # the watch's bound, not the request's
        raise APIError(
            "the request waited past its time limit (request_timeout_s) and was aborted",
            408,
            code="request_timeout",
        ) from None
    except BaseException:
        # The client went away (cancellation) or the server failed: abort downstream.
        cancel_call(replies)
        raise
    watch.saw_reply()
    return first


class ServerStream:
    """A server's stream of SSE text, which ends with its `UsageInfo`. Cut short, it still
    knows its prompt tokens (the server's first item) and counts each chunk it passed on as
    one generated token (a chunk holds one or more), so a tenant is charged for a stream
    its client left. A replica that dies under it ends it with an SSE error event."""

    def __init__(self, replies: Any, prompt_tokens: int, watch: ReplicaWatch) -> None:
        self.replies = replies
        self.prompt_tokens = prompt_tokens
        self.watch = watch
        self.chunks = 0
        self.usage: UsageInfo | None = None
        self.closed = False

    async def events(self):
        watch = self.watch
        try:
            async for item in self.replies:
                if not watch.up:  # a replica streams: one is up
                    watch.saw_reply()
                if isinstance(item, UsageInfo):
                    self.usage = item
                else:
                    self.chunks += 1
                    yield item
        except RayActorError as e:
            # Here, not at the top: the module's import loads torch (tests/unit/test_import_cost.py).
            from engine.api.stream import DONE, sse_error

            watch.saw_loss()
            yield sse_error(replica_lost(watch.model, e).to_response().model_dump())
            yield DONE

    def close(self) -> tuple[int, int]:
        """Abort the server's call unless it ended; (prompt, completion) tokens, once."""
        if self.closed:
            return 0, 0
        self.closed = True
        if self.usage is None:
            cancel_call(self.replies)
            return self.prompt_tokens, self.chunks
        return self.usage.prompt_tokens, self.usage.completion_tokens
