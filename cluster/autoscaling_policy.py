"""LLMServer's autoscaling on the engine's latency: `autoscaling_metric` queue_wait or ttft.

Each replica reports its engine's mean queue wait and time to first token over the
look-back window (cluster/autoscaling_stats.py, through Serve's `record_autoscaling_stats`);
Serve's controller averages each replica's reports over `look_back_period_s` and calls
`LatencyTargetPolicy` with them. The policy asks for

    ceil(running replicas x observed / target)

replicas, within [min_replicas, max_replicas], where `observed` is the replicas' mean: a
latency twice the target asks for twice the replicas, half of it for half. Serve wraps every
policy with its own delays: a decision takes effect once it has held for `upscale_delay_s`
(up) or `downscale_delay_s` (down), so those keys are the policy's hysteresis, as they are
for ongoing requests. The rounding up adds a little: two replicas at 0.6 x the target stay
two (ceil(1.2)); at 0.5 x or less one goes.

The decision is a pure function of the context (`desired_replicas`), tested without Ray.
Serve pickles this module by value for its controller: it imports nothing of kvray.
"""

from __future__ import annotations

import math
from typing import Any

SIGNAL_KEYS = {"queue_wait": "kvray_queue_wait_s", "ttft": "kvray_ttft_s"}
"""autoscaling_metric -> the name of its value in a replica's autoscaling stats."""
TARGET_KEYS = {"queue_wait": "target_queue_wait_s", "ttft": "target_ttft_s"}
"""autoscaling_metric -> the key that holds its target (seconds)."""

_ROUNDING_SLACK = 1e-9
"""3 x 0.1 / 0.1 is 3.0000000000000004 in floats: not a reason for a fourth replica."""


def desired_replicas(
    current: int, observed: float | None, target_s: float, min_replicas: int, max_replicas: int
) -> int:
    """ceil(current x observed / target_s) within [min_replicas, max_replicas]; `current`
    (bounded) when nothing was observed, or when no replica runs (Serve starts the first
    one on a request, whatever the policy says)."""
    if current <= 0 or observed is None:
        wanted = max(current, 0)
    else:
        wanted = math.ceil(current * observed / target_s - _ROUNDING_SLACK)
    return max(min_replicas, min(max_replicas, wanted))


def observed_mean(per_replica: dict[Any, float] | None) -> float | None:
    """The replicas' mean of one signal (None when no replica reported it yet)."""
    if not per_replica:
        return None
    return sum(per_replica.values()) / len(per_replica)


class LatencyTargetPolicy:
    """Serve's custom autoscaling policy (`AutoscalingPolicy.policy_function`, built by
    Serve with `policy_kwargs`): holds the replicas' mean `metric` at `target_s`."""

    def __init__(self, metric: str, target_s: float) -> None:
        if metric not in SIGNAL_KEYS:
            raise ValueError(f"metric must be one of {sorted(SIGNAL_KEYS)}, got {metric!r}")
        if not target_s > 0:
            raise ValueError(f"{TARGET_KEYS[metric]} must be > 0, got {target_s}")
        self.metric = metric
        self.key = SIGNAL_KEYS[metric]
        self.target_s = float(target_s)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """`ctx`: Serve's `AutoscalingContext` -> (replicas, policy state)."""
        per_replica = (ctx.aggregated_metrics or {}).get(self.key)
        decision = desired_replicas(
            ctx.current_num_replicas,
            observed_mean(per_replica),
            self.target_s,
            ctx.capacity_adjusted_min_replicas,
            ctx.capacity_adjusted_max_replicas,
        )
        return decision, {}


POLICY_FUNCTION = f"{__name__}:{LatencyTargetPolicy.__name__}"


def autoscaling_policy(metric: str, target_s: float) -> dict[str, Any]:
    """The `policy` of an autoscaling_config that scales on `metric`."""
    return {
        "policy_function": POLICY_FUNCTION,
        "policy_kwargs": {"metric": metric, "target_s": target_s},
    }


def autoscaling_keys_problem(
    metric: str,
    targets: dict[str, float | None],
    target_ongoing_requests: float | None,
    colocate_ingress: bool,
) -> str | None:
    """Why these Serve keys do not go together (None if they do). `targets`: the
    TARGET_KEYS' values by key."""
    for target_metric, key in TARGET_KEYS.items():
        if targets.get(key) is not None and metric != target_metric:
            return (
                f"{key} is the target of autoscaling_metric {target_metric}, but "
                f"autoscaling_metric is {metric}: set autoscaling_metric={target_metric} "
                f"or drop {key}"
            )
    if metric == "ongoing_requests":
        return None
    key = TARGET_KEYS[metric]
    if targets.get(key) is None:
        return f"autoscaling_metric {metric} needs {key} (seconds)"
    if target_ongoing_requests is not None:
        return (
            f"target_ongoing_requests is the target of autoscaling_metric ongoing_requests, "
            f"but autoscaling_metric is {metric} (target: {key}): drop target_ongoing_requests"
        )
    if colocate_ingress:
        return (
            f"autoscaling_metric {metric} needs LLMServer replicas, which report the engine's "
            "latency to the autoscaler; colocate_ingress=true has none: drop colocate_ingress "
            "or use autoscaling_metric ongoing_requests"
        )
    return None
