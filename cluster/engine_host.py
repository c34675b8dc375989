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

from cluster.app_config import AppConfig
from cluster.autoscaling_stats import autoscaling_signals
from cluster.metrics import RayMetricsSink, ReplicaReadiness
from cluster.prefix_routing import ROUTING_STATS_KEY, PrefixSketch, served_prefix_keys
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
        self.serving = OpenAIServing(
            self.engine,
            enable_auto_tool_choice=config.enable_auto_tool_choice,
            tool_call_parser=config.tool_call_parser,
            reasoning_parser=config.reasoning_parser,
            chat_template=config.chat_template,
            default_chat_template_kwargs=config.default_chat_template_kwargs,
            enable_prompt_tokens_details=config.enable_prompt_tokens_details,
        )
        sink = RayMetricsSink()
        self.autoscaling_signals = autoscaling_signals(config, sink, self.engine.model_name)
        self.engine.enable_metrics(self.autoscaling_signals)
        self.readiness = ReplicaReadiness(sink, self.engine.model_name)
        self.readiness.set(True)
        # Under prefix-affinity routing: the prompt starts this replica served, reported to
        # the router (record_routing_stats, cluster/prefix_router.py).
        self.served_prefixes = PrefixSketch() if config.prefix_affinity else None
        self.block_size = config.block_size

    async def generate(self, kind: str, request: Any, ctx: RequestContext):
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
        if not isinstance(result, SSEStream):
            yield result.model_dump(mode="json")
            return
        events = result.events
        yield result.prompt_tokens
        try:
            async for text in events:
                yield text
        finally:
            # A caller in the same process closes this generator at its `yield`, where
            # no cancellation reaches `events`: close it, so the engine request ends now.
            await events.aclose()
        yield result.usage

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
        return self.serving.models().model_dump(mode="json")

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
