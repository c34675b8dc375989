"""The HTTP side of a kvray app: `OpenAIIngress`, a Serve deployment of OpenAI's routes,
and of the same requests over gRPC (its methods of cluster/grpc_api/methods.py run
`run_generation` and `run_tokenizer_call`, the routes' own request path).

The ingress owns everything about HTTP: body size, API keys, tenants and their limits,
request validation, turning the servers' replies into responses. It picks a model's
server (an LLMServer handle, cluster/engine_host.py) by the request's `model`
(cluster/model_router.py); with `colocate_ingress` it holds the engine itself and talks to
it through the same interface as to a handle (cluster/local_server.py). What a server
sends back per request is described in cluster/engine_host.py; how a generation request
waits for it, and what a replica that dies under it becomes, in cluster/server_calls.py.
While a model has no replica up, /health and new requests answer 503 without waiting on
Serve (cluster/replica_watch.py).

Importing this module loads no torch (tests/unit/test_import_cost.py): the engine's
modules load when a replica starts.

Longer than most modules because Serve builds the HTTP app from this one class: its routes,
their wiring to the admin API (cluster/admin_api.py), the replica watches and the gRPC
methods' entry points are methods of `OpenAIIngress`. What a route does beyond that lives
in the modules named above.
"""

# No `from __future__ import annotations` here: FastAPI reads the signatures of the route
# methods (`__serve_build_asgi_app__`), and string annotations do not resolve there.
import asyncio
import contextvars
import importlib.metadata
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.exceptions import RayActorError, TaskCancelledError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle
from starlette.requests import ClientDisconnect

from cluster.admin_api import ADMIN_OPERATIONS, ADMIN_PREFIX, AdminAuth, ModelAdmin
from cluster.app_config import AppConfig
from cluster.grpc_api.methods import GrpcMethods
from cluster.http_app import (
    HTTP_REPLIES,
    HotRoutes,
    build_fastapi_app,
    error_response,
)
from cluster.local_server import LocalServer, colocated_capacity
from cluster.metrics import RayMetricsSink, kvray_metrics_text, metrics_notice
from cluster.model_router import ModelRouter
from cluster.replica_watch import (
    RETRY_AFTER_S,
    ReplicaWatch,
    cancel_call,
    no_replica,
    replica_lost,
)
from cluster.request_bodies import REQUEST_MODELS, parse_body, publish_request_bodies, read_body
from cluster.server_calls import GenerationReplies, ServerStream, first_reply
from cluster.tenants import TenantResolver
from engine.api.errors import APIError, quoted_names
from engine.observability.gc_pauses import tune_for_serving
from engine.observability.hop_trace import hop
from engine.observability.tenant_metrics import TenantMetrics
from engine.tenants import DEFAULT_TENANT

if TYPE_CHECKING:
    from cluster.engine_host import EngineHost
    from engine.api.serving import RequestContext

logger = logging.getLogger("ray.serve")

CLIENT_GONE = 499
"""The status a request whose client went away is counted under (nginx's, and Serve's)."""

_REQUEST_ID = re.compile(r"[!-~]{1,128}")


def client_request_id(headers: Any) -> str | None:
    """The request's X-Request-Id (vLLM's: response ids carry it; Serve's direct ingress
    sets one where the client gave none, and answers with it), if it is printable ASCII
    without spaces, at most 128 characters; else None."""
    value = headers.get("x-request-id")
    return value if value is not None and _REQUEST_ID.fullmatch(value) else None


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress(GrpcMethods):
    async def __init__(
        self,
        server: DeploymentHandle | dict[str, DeploymentHandle] | None,
        config: AppConfig,
        limiter: DeploymentHandle | None = None,
    ) -> None:
        """`server`: the one model's LLMServer, or served name -> LLMServer for several;
        None: this replica holds the engine itself (colocate_ingress)."""
        # The ingress holds every stream's HTTP state: a full collection walks all of it.
        tune_for_serving()
        # engine.api.serving loads the tokenizer's modules (and torch): here, when the
        # replica starts, rather than when this module is imported.
        from engine.api.serving import RequestContext

        self.request_context_type = RequestContext
        self.host: EngineHost | None = None
        if server is None:
            from cluster import engine_host

            self.host = engine_host.EngineHost()
            await self.host.start(config)
            server = LocalServer(self.host, colocated_capacity(config))
        servers = server if isinstance(server, dict) else {config.served_name: server}
        aliases = {name: c.served_name for c in config.model_configs() for name in c.served_names}
        self.router = ModelRouter(servers, aliases)
        # A model that may scale to zero waits for its first replica: a request starts it.
        waits = {
            c.served_name: None if c.min_replicas == 0 else config.no_replica_wait_s
            for c in config.model_configs()
        }
        self.watches = {
            name: ReplicaWatch(name, handle, waits.get(name, config.no_replica_wait_s))
            for name, handle in servers.items()
        }
        self.config = config
        self.admin_auth = AdminAuth(config.admin_api_keys, config.api_keys)
        self.admin = ModelAdmin(
            servers, self.router, self.admin_auth, config.max_request_body_bytes
        )
        self.limiter = limiter
        self.resolver = TenantResolver(config.api_keys, config.tenants)
        # With API keys the tenants are the keys' (a bounded set); without, any header value.
        named = None if config.api_keys else {*config.tenants, DEFAULT_TENANT}
        self.tenant_metrics = TenantMetrics(RayMetricsSink(), named)
        try:
            self.app_name: str | None = serve.get_replica_context().app_name
        except RayServeException:  # built outside Serve (tests)
            self.app_name = None
        logger.info(metrics_notice())

    def __serve_build_asgi_app__(self) -> HotRoutes:
        """The replica's HTTP app (Serve calls this once __init__ has returned)."""
        fastapi_app = build_fastapi_app(
            {
                ("GET", "/health"): self.health,
                ("GET", "/v1/models"): self.models,
                # `:path`: served names may hold slashes (meta-llama/Llama-3.1-8B).
                ("GET", "/v1/models/{model_id:path}"): self.model,
                ("GET", "/version"): self.version,
                ("GET", "/metrics"): self.metrics,
                ("POST", "/v1/completions"): self.completions,
                ("POST", "/v1/chat/completions"): self.chat_completions,
                ("POST", "/tokenize"): self.tokenize,
                ("POST", "/detokenize"): self.detokenize,
                # Only with admin keys: without, /v1/admin/* is no route at all (404, no 405).
                **{
                    (method, ADMIN_PREFIX + operation): self._admin_route(operation)
                    for method, operation in ADMIN_OPERATIONS
                    if self.admin_auth.enabled
                },
            }
        )
        kinds = {
            "/v1/completions": "completion",
            "/v1/chat/completions": "chat",
            "/tokenize": "tokenize",
            "/detokenize": "detokenize",
        }
        publish_request_bodies(fastapi_app, {p: REQUEST_MODELS[k] for p, k in kinds.items()})
        hot = {"/v1/completions": self.completions, "/v1/chat/completions": self.chat_completions}
        return HotRoutes(hot, fastapi_app)

    def _admin_route(self, operation: str) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await self.admin.respond(request, operation)

        return endpoint

    async def stats(self, model: str | None = None) -> dict:
        """The engine's counters of `model` (tests and tools; not an HTTP route)."""
        return await self.router.server(model).stats.remote()

    def unhealthy(self, down: list[str]) -> APIError:
        return APIError(
            f"no healthy replica of {quoted_names(down)}",
            503,
            code="unhealthy",
            retry_after_s=RETRY_AFTER_S,
        )

    async def down_models(self) -> list[str]:
        """The models without a healthy replica: at once those known to have none up,
        else those whose server does not answer healthy within a second."""
        watches = list(self.watches.values())
        down = [w.model for w in watches if not w.up]
        if not down:
            answers = await asyncio.gather(*(w.probe() for w in watches))
            down = [w.model for w, healthy in zip(watches, answers) if not healthy]
        return down

    def check_health(self) -> None:
        if self.host is not None:
            self.host.check_health()

    def __del__(self) -> None:
        if getattr(self, "host", None) is not None:
            self.host.shutdown()

    async def health(self) -> Response:
        """200 once every model's server answers healthy within a second; 503 at once
        while a model has no replica known to be up."""
        down = await self.down_models()
        if down:
            return error_response(self.unhealthy(down))
        return JSONResponse({"status": "healthy", "models": self.router.names})

    async def models(self, request: Request) -> JSONResponse:
        try:
            self.resolver.resolve(request.headers)
        except APIError as e:
            return error_response(e)
        self._models_may_change()
        return JSONResponse(await self.router.models())

    def _models_may_change(self) -> None:
        # With the admin API on, another ingress replica may have switched a model: the
        # list (each card's `root`, the checkpoint a replica runs) is asked for each time.
        if self.admin_auth.enabled:
            self.router.forget_models()

    async def model(self, request: Request, model_id: str) -> JSONResponse:
        try:
            self.resolver.resolve(request.headers)
            self._models_may_change()
            return JSONResponse(await self.router.model_card(model_id))
        except APIError as e:
            return error_response(e)

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": importlib.metadata.version("kvray")})

    async def metrics(self) -> Response:
        """The app's kvray metrics, Prometheus text: every Ray node's `ray_kvray_*` series
        (cluster/metrics.py), the names and labels the dashboard queries."""
        text = await kvray_metrics_text(self.app_name)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def tokenize(self, request: Request) -> JSONResponse:
        return await self._tokenizer_call(request, "tokenize")

    async def detokenize(self, request: Request) -> JSONResponse:
        return await self._tokenizer_call(request, "detokenize")

    async def _tokenizer_call(self, request: Request, kind: str) -> Response:
        try:
            result = await self.run_tokenizer_call(
                request.headers, lambda: self._parse_body(request, kind), kind
            )
        except APIError as e:
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(result)

    async def run_tokenizer_call(
        self, headers: Mapping[str, str], parse: Callable[[], Awaitable[Any]], kind: str
    ) -> dict:
        """vLLM's /tokenize and /detokenize: the server's tokenizer, no engine step; the
        answer's JSON, or APIError. `parse()` gives the request's model (HTTP or gRPC)."""
        self.resolver.resolve(headers)
        parsed = await parse()
        model = self.router.name_for(parsed.model)
        await self._wait_for_replica(model)
        try:
            result = await getattr(self.router.servers[model], kind).remote(parsed)
        except RayActorError as e:
            self.watches[model].saw_loss()
            raise replica_lost(model, e) from None
        if isinstance(result, APIError):
            raise result
        return result

    async def _generate(self, request: Request, kind: str) -> Response:
        return await self.run_generation(
            request.headers, lambda: self._parse_body(request, kind), kind, HTTP_REPLIES
        )

    async def run_generation(
        self,
        headers: Mapping[str, str],
        parse: Callable[[], Awaitable[Any]],
        kind: str,
        replies: GenerationReplies,
    ) -> Any:
        """A completion or chat completion however it came (HTTP, gRPC): tenant, limits,
        time limit, the model's server, accounting. `parse()` gives the request's model
        (APIError naming the field if it is not one); `replies` turn the outcome into the
        protocol's answer."""
        received = time.time()
        lease = None
        tenant_name = "unauthenticated"
        model_name = ""
        try:
            tenant = self.resolver.resolve(headers)
            tenant_name = tenant.name
            parsed = await parse()
            hop("parsed")
            model_name = self.router.name_for(parsed.model)
            server = self.router.stream(model_name)
            await self._wait_for_replica(model_name)
            lease = await self._acquire(tenant.name)
            timeout = tenant.config.time_limit_s(self.config.request_timeout_s)
            ctx = self.request_context_type(
                request_id=client_request_id(headers),
                priority=tenant.config.priority,
                cache_salt=tenant.cache_salt,
                deadline=None if timeout is None else received + timeout,
            )
            response = await self._call_server(
                server, kind, parsed, ctx, lease, model_name, tenant.name, replies
            )
        except APIError as e:
            self._release(lease, 0)
            self.tenant_metrics.request_done(model_name, tenant_name, e.status_code)
            if e.status_code == 429:
                self.tenant_metrics.rejected(model_name, tenant_name, e.code or "rate_limited")
            return replies.error(e)
        except ClientDisconnect:
            # Gone while its body was read: nothing was started, no one to answer.
            self.tenant_metrics.request_done(model_name, tenant_name, CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        except BaseException as e:
            # The server failed, or the client went away (Serve cancels the request's task):
            # the tenant's slot comes back all the same.
            self._release(lease, 0)
            gone = isinstance(e, (TaskCancelledError, asyncio.CancelledError))
            self.tenant_metrics.request_done(model_name, tenant_name, CLIENT_GONE if gone else 500)
            raise
        self.tenant_metrics.request_done(model_name, tenant_name, 200)
        return response

    async def _wait_for_replica(self, model: str) -> None:
        """Return once `model` has a replica known to be up; 503 past the app's bound."""
        watch = self.watches[model]
        if not watch.up and not await watch.wait_up():
            raise no_replica(model)

    async def _parse_body(self, request: Request, kind: str) -> Any:
        """The body as `kind`'s request model; APIError (413, 400 naming the field) if not."""
        body = await read_body(request, self.config.max_request_body_bytes)
        return parse_body(body, kind, self.config.max_completion_prompts)

    async def _acquire(self, tenant: str) -> str | None:
        if self.limiter is None or not self.config.tenant(tenant).has_limits:
            return None
        admission = await self.limiter.acquire.remote(tenant)
        if admission.lease_id is None:
            raise APIError(
                admission.reason,
                429,
                code="rate_limit_exceeded",
                retry_after_s=admission.retry_after_s,
            )
        return admission.lease_id

    def _release(self, lease: str | None, tokens: int) -> None:
        if lease is not None:
            # Not awaited: the request is sent at .remote(), and a release must not hold up
            # a response whose client has gone. Sent from an empty context, so it is not a
            # child of the client's request: Serve cancels those with it, and a release made
            # while the disconnect is being handled was lost that way now and then.
            contextvars.Context().run(self.limiter.release.remote, lease, tokens)

    async def _call_server(
        self,
        server: Any,
        kind: str,
        parsed: Any,
        ctx: "RequestContext",
        lease: str | None,
        model: str,
        tenant: str,
        replies: GenerationReplies,
    ) -> Any:
        """`server`: the streaming handle of the request's model."""
        watch = self.watches[model]
        first_items, first = await first_reply(server, watch, kind, parsed, ctx)
        if isinstance(first, APIError):
            cancel_call(first_items)
            raise first
        if isinstance(first, dict):
            cancel_call(first_items)
            usage = first.get("usage", {})
            self._charge(
                lease,
                model,
                tenant,
                usage.get("prompt_tokens", 0),
                usage.get("completion_tokens", 0),
            )
            return replies.whole(first)
        stream = ServerStream(first_items, first, watch)
        # From here the answer owns the slot: it gives it back when the stream ends,
        # however it ends (also when the client leaves before the first item is sent).
        return replies.stream(stream, lambda: self._charge(lease, model, tenant, *stream.close()))

    def _charge(
        self, lease: str | None, model: str, tenant: str, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """A request has ended: charge its tokens to its tenant and give back its slot."""
        self._release(lease, prompt_tokens + completion_tokens)
        self.tenant_metrics.tokens(model, tenant, prompt_tokens, completion_tokens)
