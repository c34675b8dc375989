"""A replica's engine: `EngineHost` builds it and answers for it; `LLMServer` is the Serve
deployment of one (one engine per replica).

The host owns the engine: tokenization and chat templates run next to it (they need its
tokenizer and max_model_len), and it streams ready-made SSE text back to the ingress
(cluster/ingress.py), which owns everything about HTTP.

What travels from host to ingress, per request: the first item is an `APIError`, a
response body (dict) or the prompt tokens (an int: a stream has started, the engine took
the request); a stream then continues with SSE text and ends with its `UsageInfo` (for
per-tenant token accounting, never sent to the client).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve
from ray.serve.exceptions import RayServeException

from cluster.app_config import AppConfig
from cluster.autoscaling_stats import autoscaling_signals
from cluster.metrics import RayMetricsSink, ReplicaReadiness
from cluster.prefix_routing import ROUTING_STATS_KEY, PrefixSketch, served_prefix_keys
from cluster.replica_lifecycle import ReplicaLifecycle, switch_aborted
from engine.api.errors import APIError
from engine.api.serving import OpenAIServing, RequestContext, SSEStream
from engine.config import EngineArgs
from engine.observability.gc_pauses import tune_for_serving


def make_engine(config: AppConfig) -> Any:
    """The one place a replica builds its engine.

    On one GPU the engine runs in a process of its own next to the replica's (the replica's
    event loop and the engine would otherwise take turns at the GIL); a tensor/pipeline-
    parallel group is driven from the replica's process, its workers placed in the
    replica's placement group.
    """
    from engine.async_engine import AsyncEngine

    return AsyncEngine.from_engine_args(engine_args(config), engine_process=config.engine_process)


def engine_args(config: AppConfig) -> EngineArgs:
    """The config's engine arguments, the Ray actor group passed down as the executor of
    several ranks (or of one, where distributed_executor_backend asks for "ray")."""
    args = config.engine_args()
    backend = args.distributed_executor_backend
    if backend == "ray" or (backend is None and args.world_size > 1):
        from cluster.executor import RayActorGroupExecutor

        args = args.model_copy(update={"distributed_executor_backend": RayActorGroupExecutor})
    return args


class EngineHost:
    """A replica's engine and its OpenAI serving layer (LLMServer's methods)."""

    served_prefixes: PrefixSketch | None = None

    async def start(self, config: AppConfig) -> None:
        # Serve freezes a replica's start-up heap once its __init__ returns
        # (RAY_SERVE_FREEZE_GC_ON_STARTUP); the engine process freezes its own.
        tune_for_serving()
        # A replica runs its code on its main loop, which should keep answering Serve
        # (health checks, metrics) while the model loads: build the engine on a thread.
        self.engine = await asyncio.to_thread(make_engine, config)
        self.config = config
        self.serving = self._serving()
        # The names requests give stay the app's across model switches (docs/serving.md).
        self.served_names = list(self.serving.served.model_names)
        self.model_path = config.model
        sink = RayMetricsSink()
        self.autoscaling_signals = autoscaling_signals(config, sink, self.engine.model_name)
        self.engine.enable_metrics(self.autoscaling_signals)
        self.readiness = ReplicaReadiness(sink, self.engine.model_name)
        self.readiness.set(True)
        self.lifecycle = ReplicaLifecycle(
            self.served_names[0],
            self.engine.call,
            self._load,
            self._warm_up,
            drain_timeout_s=config.switch_drain_timeout_s,
            wake_on_request=config.wake_on_request,
            sink=sink,
        )
        # Under prefix-affinity routing: the prompt starts this replica served, reported to
        # the router (record_routing_stats, cluster/prefix_router.py).
        self.served_prefixes = PrefixSketch() if config.prefix_affinity else None
        self.block_size = config.block_size

    def _serving(self) -> OpenAIServing:
        config = self.config
        return OpenAIServing(
            self.engine,
            enable_auto_tool_choice=config.enable_auto_tool_choice,
            tool_call_parser=config.tool_call_parser,
            reasoning_parser=config.reasoning_parser,
            chat_template=config.chat_template,
            default_chat_template_kwargs=config.default_chat_template_kwargs,
            enable_prompt_tokens_details=config.enable_prompt_tokens_details,
        )

    async def generate(self, kind: str, request: Any, ctx: RequestContext):
        refused = await self.lifecycle.admit()
        if refused is not None:
            yield refused
            return
        # No await between admit and started: a drain must see every request that runs.
        running = self.lifecycle.started()
        streaming = False
        try:
            if self.served_prefixes is not None:
                self.served_prefixes.add(served_prefix_keys(kind, request, ctx, self.block_size))
            try:
                if kind == "chat":
                    result = await self.serving.create_chat_completion(request, ctx)
                else:
                    result = await self.serving.create_completion(request, ctx)
            except APIError as e:
                yield e
                return
            finally:
                running.in_engine = False
            if not isinstance(result, SSEStream):
                yield result.model_dump(mode="json")
                return
            events = result.events
            streaming = True
            yield result.prompt_tokens
            try:
                # `in_engine` marks where a drain may cancel this task (ReplicaRequest says why).
                while not running.aborted:
                    running.in_engine = True
                    try:
                        text = await anext(events)
                    except StopAsyncIteration:
                        break
                    finally:
                        running.in_engine = False
                    yield text
            finally:
                # A caller in the same process closes this generator at its `yield`, where
                # no cancellation reaches `events`: close it, so the engine request ends now.
                await events.aclose()
            if not running.aborted:
                yield result.usage
                return
        except asyncio.CancelledError:
            if not self.lifecycle.took_back(running):
                raise
        finally:
            self.lifecycle.ended(running)
        # Aborted by a drain (cluster/replica_lifecycle.py): a clear error, as an SSE event
        # where the stream has begun.
        error = switch_aborted(self.lifecycle.model)
        if not streaming:
            yield error
            return
        from engine.api.stream import DONE, sse_error

        yield sse_error(error.to_response().model_dump())
        yield DONE

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve's controller pulls for the router: the served prompt starts as a
        Bloom filter (none unless routing is prefix_affinity)."""
        sketch = self.served_prefixes
        return {} if sketch is None else {ROUTING_STATS_KEY: sketch.bloom()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler gets every metrics interval: the engine's recent queue
        wait or time to first token under autoscaling_metric queue_wait / ttft
        (cluster/autoscaling_stats.py)."""
        return self.autoscaling_signals.report()

    def models(self) -> dict:
        """OpenAI's model list; each card's `root` is the checkpoint the replica runs now."""
        listing = self.serving.models().model_dump(mode="json")
        for card in listing["data"]:
            card["root"] = self.model_path
        return listing

    # -- the model lifecycle (cluster/replica_lifecycle.py; the ingress's admin routes) ----

    def replica_id(self) -> str:
        try:
            return serve.get_replica_context().replica_id.unique_id
        except RayServeException:  # an EngineHost outside Serve (colocated, tests)
            return "local"

    async def admin(self, replica: str | None, operation: str, *args: Any) -> Any:
        """Run `operation` of the lifecycle if `replica` is this one (None: any replica), else
        nothing: the ingress broadcasts a rolling switch's step to every replica, one
        replica acting at a time. Returns (replica id, result or APIError)."""
        me = self.replica_id()
        if replica is not None and replica != me:
            return me, None
        if operation == "replica_id":
            return me, {}
        try:
            result = getattr(self.lifecycle, operation)(*args)
            if asyncio.iscoroutine(result):
                result = await result
        except APIError as e:
            return me, e
        return me, result

    async def _load(self, model: str, weights_only: bool) -> None:
        """The idle engine loads `model` (a whole switch keeps the served names, so the
        engine's metrics keep their `model` label); what was read off the old one is read
        again."""
        names = {} if weights_only else {"served_model_name": self.served_names}
        await self.engine.call("load_model", model, weights_only, **names)
        await self.engine.refresh_model_info()
        old = self.serving
        self.serving = self._serving()
        self.serving.served.model_names = list(self.served_names)
        self.serving.served.model_name = self.served_names[0]
        pool = getattr(old.served, "_tokenize_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
        self.model_path = model
        if self.served_prefixes is not None:  # the engine's prefix cache was reset
            self.served_prefixes = PrefixSketch()

    async def _warm_up(self) -> None:
        """One token through the model before it takes traffic again."""
        from engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in self.engine.generate([1, 2, 3], params, f"warm-up-{id(params)}"):
            pass

    async def tokenize(self, request: Any) -> dict | APIError:
        try:
            return (await self.serving.tokenize(request)).model_dump(mode="json")
        except APIError as e:
            return e

    def detokenize(self, request: Any) -> dict | APIError:
        try:
            return self.serving.detokenize(request).model_dump(mode="json")
        except APIError as e:
            return e

    async def stats(self) -> dict:
        return await self.engine.stats()

    def is_healthy(self) -> bool:
        return self.engine.is_healthy

    def check_health(self) -> None:
        self.lifecycle.publish()
        if self.lifecycle.state == "switching":
            # A whole switch tears the engine's executor down and builds it again on the
            # engine's thread: its own check would see it half-built, and Serve would
            # replace a replica that is only loading.
            return
        self.readiness.set(self.engine.is_healthy)
        self.engine.check_health()

    def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=5)


@serve.deployment(name="LLMServer")
class LLMServer(EngineHost):
    async def __init__(self, config: AppConfig) -> None:
        await self.start(config)

    def __del__(self) -> None:
        self.shutdown()
