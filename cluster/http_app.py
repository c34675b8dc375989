"""The ingress's HTTP application: a FastAPI app of every route, and in front of it a bare
ASGI dispatcher that sends the two generation routes straight to their handler.

Why: FastAPI's routing, its middleware stack and its per-request dependency machinery cost
CPU time on every request (bench/RESULTS.md has the measurements), and the generation
routes need none of them: they take the raw request and return a finished response. Every
other route, and every other method on those paths, goes through FastAPI.
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures, and
# string annotations of these closures' types would not resolve.
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.server_calls import GenerationReplies
from engine.api.errors import APIError
from engine.observability import hop_trace

logger = logging.getLogger("ray.serve")

Handler = Callable[[Request], Awaitable[Response]]


def error_response(e: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """`e` as OpenAI's error body; `headers` go out beside its own (Retry-After)."""
    return JSONResponse(
        e.to_response().model_dump(mode="json"),
        status_code=e.status_code,
        headers={**(headers or {}), **e.headers()},
    )


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    code = "not_found" if exc.status_code == 404 else None
    # A 405's `Allow` (the methods the path takes) is in exc.headers.
    return error_response(
        APIError(f"{message}: {request.method} {request.url.path}", exc.status_code, code=code),
        exc.headers,
    )


async def _route_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(APIError(f"invalid request: {exc.errors()}"))


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, TaskCancelledError):
        # The client disconnected: nobody reads this response.
        return error_response(APIError("the client disconnected", 499))
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(APIError(f"internal error: {type(exc).__name__}", 500))


class ClosingStreamingResponse(StreamingResponse):
    """Streams in the request's own task and closes its body generator however it ends.

    Serve watches every request for its client's disconnect and cancels the request's
    task when it comes (through its proxy and with direct ingress alike), so Starlette's
    second watcher (a task group, with the stream in a task of its own, each request)
    only delays the first chunk. When the client goes away while the generator waits at
    a `yield`, its `finally` (abort downstream, release the tenant's slot) must not wait
    for the garbage collector: close it here.
    """

    def __init__(self, content: Any, *, on_close: Callable[[], None] | None = None, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close
        """Runs once the response has ended, however it ended: a generator cancelled
        before its first item (the client left while the headers went out) never reaches
        its own `finally`."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.stream_response(send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()


def build_fastapi_app(routes: dict[tuple[str, str], Callable[..., Any]]) -> FastAPI:
    """A FastAPI app of `routes` ((method, path) -> endpoint) with OpenAI-shaped errors."""
    app = FastAPI(title="kvray", docs_url=None, redoc_url=None)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _route_error)
    app.add_exception_handler(Exception, internal_error)
    for (method, path), endpoint in routes.items():
        app.add_api_route(path, endpoint, methods=[method])
    return app


def _traced(send: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
    """`send`, tracing the response's start and each SSE event with data."""

    async def traced_send(message: Any) -> None:
        if message["type"] == "http.response.start":
            hop_trace.hop("send_start")
        elif message.get("body", b"").startswith(b"data: {"):
            hop_trace.hop("send_body")
        await send(message)

    return traced_send


class HotRoutes:
    """An ASGI app: POSTs to `handlers`' paths go to their handler as a Starlette request,
    everything else (other routes, other methods, lifespan) to `fallback`."""

    def __init__(self, handlers: dict[str, Handler], fallback: FastAPI):
        self.handlers = handlers
        self.fallback = fallback
        self.exception_handlers: dict[type[Exception], Callable[..., Any]] = {}

    def add_exception_handler(self, exc_class: type[Exception], handler: Callable) -> None:
        """Serve registers its own here (its unavailable-deployment errors as 503s), as it
        would on a FastAPI app: they apply to both paths."""
        self.exception_handlers[exc_class] = handler
        self.fallback.add_exception_handler(exc_class, handler)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        handler = self._handler(scope)
        if handler is None:
            await self.fallback(scope, receive, send)
            return
        hop_trace.hop("handler_start")
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except Exception as e:
            response = await self._error_response(request, e)
        await response(scope, receive, _traced(send) if hop_trace.enabled() else send)

    async def _error_response(self, request: Request, exc: Exception) -> Response:
        on_error = next(
            (self.exception_handlers[c] for c in type(exc).__mro__ if c in self.exception_handlers),
            internal_error,
        )
        response = on_error(request, exc)
        return await response if inspect.isawaitable(response) else response

    def _handler(self, scope: Any) -> Handler | None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        path = scope["path"]
        # Under a route prefix, Serve's server keeps it in `path` and names it `root_path`.
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        return self.handlers.get(path)


HTTP_REPLIES = GenerationReplies(
    error=error_response,
    whole=JSONResponse,
    stream=lambda stream, on_close: ClosingStreamingResponse(
        stream.events(), media_type="text/event-stream", on_close=on_close
    ),
)
"""A generation request's answers over HTTP: OpenAI's error body, JSON, SSE."""
