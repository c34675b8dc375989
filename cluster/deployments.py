"""The Serve application of a kvray app: `OpenAIIngress` (HTTP, cluster/ingress.py) ->
`LLMServer` (one engine per replica, cluster/engine_host.py), and each deployment's options.

With `models` the app has one LLMServer deployment per model (`LLMServer:<served name>`,
each with its own replicas and placement) and the ingress picks one by the request's
`model` (cluster/model_router.py).

With `colocate_ingress` the ingress holds the engine itself (one deployment, no Ray call
between HTTP and the engine), and takes LLMServer's options.

Tenants with limits add `TenantLimiter`, one replica that every ingress replica asks.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from cluster.app_config import AppConfig, llm_server_name
from cluster.engine_host import LLMServer
from cluster.grpc_api.serve_setup import ensure_serve_grpc
from cluster.ingress import OpenAIIngress
from cluster.local_server import colocated_capacity
from cluster.placement import placement_strategy, rank_bundles, replica_cpus_per_rank
from cluster.topology import SERVE_FAST_PATH_ENV
from engine.tenants import TenantLimiter


@serve.deployment(name="TenantLimiter", num_replicas=1, max_ongoing_requests=100_000)
class TenantLimiterDeployment(TenantLimiter):
    pass


def build_openai_app(config: AppConfig) -> Any:
    """The Serve application: ingress -> LLMServer, one per model (+ TenantLimiter when
    tenants have limits); with colocate_ingress the ingress replicas take LLMServer's
    options and hold the engine."""
    if config.grpc_port:
        ensure_serve_grpc(config.grpc_port)
    config = config.with_resolved_device()
    limiter = None
    if config.has_tenant_limits:
        limiter = TenantLimiterDeployment.options(
            ray_actor_options={"num_cpus": 0, "runtime_env": _replica_env()}
        ).bind(config.tenants, config.request_timeout_s)
    if config.colocate_ingress:
        (model,) = config.model_configs()  # app_config refuses colocation of several
        options = llm_server_options(model)
        # The ingress bounds the queue itself (LocalServer); Serve's bound sits above it,
        # with room for /health and /v1/models, so that an overload gets OpenAI's 429.
        options["max_ongoing_requests"] = colocated_capacity(model) + 64
        options["max_queued_requests"] = -1
        return OpenAIIngress.options(**options).bind(None, model, limiter)
    if config.models is None:
        servers: Any = LLMServer.options(**llm_server_options(config)).bind(config)
    else:
        servers = {
            model.served_name: LLMServer.options(
                name=llm_server_name(model.served_name), **llm_server_options(model)
            ).bind(model)
            for model in config.model_configs()
        }
    ingress = OpenAIIngress.options(
        autoscaling_config={
            "min_replicas": config.ingress_min_replicas,
            "max_replicas": config.ingress_max_replicas,
            "target_ongoing_requests": config.ingress_target_ongoing_requests,
        },
        max_ongoing_requests=config.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": config.ingress_num_cpus, "runtime_env": _replica_env()},
    )
    return ingress.bind(servers, config, limiter)


def _replica_env() -> dict[str, Any]:
    return {"env_vars": dict(SERVE_FAST_PATH_ENV)}


def llm_server_options(config: AppConfig) -> dict[str, Any]:
    """Deployment options of `LLMServer`: autoscaling, queue bounds and placement.

    One placement-group bundle per rank (cluster/placement.py); the replica itself runs
    in bundle 0 and takes its CPUs.
    """
    cuda = config.device == "cuda"
    world_size = config.world_size
    num_cpus = replica_cpus_per_rank(config.device, config.num_cpus)
    max_ongoing = config.resolved_max_ongoing_requests()
    autoscaling: dict[str, Any] = {
        "min_replicas": config.min_replicas,
        "max_replicas": config.max_replicas,
        "target_ongoing_requests": config.target_ongoing_requests or max(1.0, max_ongoing / 2),
        "upscale_delay_s": config.upscale_delay_s,
        "downscale_delay_s": config.downscale_delay_s,
        "look_back_period_s": config.look_back_period_s,
    }
    if config.initial_replicas is not None:
        autoscaling["initial_replicas"] = config.initial_replicas
    if config.metrics_interval_s is not None:
        autoscaling["metrics_interval_s"] = config.metrics_interval_s
    if config.autoscaling_metric != "ongoing_requests":
        autoscaling.update(latency_autoscaling(config))
    options: dict[str, Any] = {
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": max_ongoing,
        "max_queued_requests": config.resolved_max_queued_requests(),
        "ray_actor_options": {
            "num_cpus": num_cpus,
            # With one rank the engine runs in the replica and needs the GPU itself.
            "num_gpus": 1.0 if cuda and world_size == 1 else 0.0,
            "runtime_env": _replica_env(),
        },
        "placement_group_bundles": rank_bundles(world_size, config.device, num_cpus),
        "placement_group_strategy": placement_strategy(config.pipeline_parallel_size),
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
    }
    if config.prefix_affinity:
        options["request_router_config"] = prefix_affinity_router(config)
    return options


def latency_autoscaling(config: AppConfig) -> dict[str, Any]:
    """LLMServer's autoscaling_config keys under autoscaling_metric queue_wait or ttft:
    Serve's custom policy on what the replicas report (cluster/autoscaling_policy.py)."""
    from cluster.autoscaling_policy import TARGET_KEYS, autoscaling_policy

    metric = config.autoscaling_metric
    return {"policy": autoscaling_policy(metric, getattr(config, TARGET_KEYS[metric]))}


ROUTING_STATS_PERIOD_S = 1.0
"""How often Serve's controller pulls each replica's served prefixes for the router (the
router knows what it sent itself at once: this covers other ingress replicas' requests)."""


def prefix_affinity_router(config: AppConfig) -> Any:
    """LLMServer's request router under `routing: prefix_affinity`."""
    from ray.serve.config import RequestRouterConfig

    from cluster.prefix_router import PrefixAffinityRouter

    return RequestRouterConfig(
        request_router_class=PrefixAffinityRouter,
        request_router_kwargs={
            "block_size": config.block_size,
            "load_factor": config.routing_load_factor,
            "model": config.served_name,
        },
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
    )
