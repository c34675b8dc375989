"""Latency autoscaling without a Serve app: the policy's decisions on a table of contexts
(cluster/autoscaling_policy.py), the replica's windows and report
(cluster/autoscaling_stats.py), the keys and the autoscaling_config they make."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.app_config import load_app_config
from cluster.autoscaling_policy import (
    SIGNAL_KEYS,
    LatencyTargetPolicy,
    desired_replicas,
)
from cluster.autoscaling_stats import AutoscalingSignals, LatencyWindow
from cluster.deployments import llm_server_options

TTFT = SIGNAL_KEYS["ttft"]
QUEUE = SIGNAL_KEYS["queue_wait"]


def _context(current, metrics, lo=1, hi=4, target=None):
    return SimpleNamespace(
        current_num_replicas=current,
        target_num_replicas=current if target is None else target,
        aggregated_metrics=metrics,
        capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi,
    )


# (replicas running, reported TTFT per replica, min, max) -> replicas wanted; target 0.5 s.
DECISIONS = [
    pytest.param(1, {"a": 1.0}, 1, 4, 2, id="twice-the-target-doubles"),
    pytest.param(1, {"a": 0.5}, 1, 4, 1, id="at-the-target-stays"),
    pytest.param(1, {"a": 0.51}, 1, 4, 2, id="just-over-adds-one"),
    pytest.param(2, {"a": 0.9, "b": 0.1}, 1, 4, 2, id="mean-over-replicas"),
    pytest.param(2, {"a": 0.3, "b": 0.3}, 1, 4, 2, id="0.6x-keeps-two"),
    pytest.param(2, {"a": 0.25, "b": 0.25}, 1, 4, 1, id="half-drops-one"),
    pytest.param(3, {"a": 0.0, "b": 0.0, "c": 0.0}, 1, 4, 1, id="idle-goes-to-min"),
    pytest.param(3, {"a": 0.0, "b": 0.0, "c": 0.0}, 0, 4, 0, id="idle-to-zero-if-allowed"),
    pytest.param(2, {"a": 5.0, "b": 5.0}, 1, 4, 4, id="capped-at-max"),
    pytest.param(2, {}, 1, 4, 2, id="nothing-reported-keeps"),
    pytest.param(5, {}, 1, 4, 4, id="nothing-reported-still-bounded"),
    pytest.param(0, {"a": 3.0}, 0, 4, 0, id="no-replica-left-to-serve"),
]


@pytest.mark.parametrize("current, reported, lo, hi, expected", DECISIONS)
def test_policy_decisions(current, reported, lo, hi, expected):
    policy = LatencyTargetPolicy("ttft", 0.5)
    # The other signal's reports must not count.
    metrics = {TTFT: reported, QUEUE: {k: 100.0 for k in reported}} if reported else {}
    decision, state = policy(_context(current, metrics, lo, hi))
    assert decision == expected
    assert state == {}


def test_policy_reads_its_own_signal_and_handles_no_metrics_at_all():
    queue_policy = LatencyTargetPolicy("queue_wait", 0.2)
    ctx = _context(1, {QUEUE: {"a": 0.6}, TTFT: {"a": 0.0}})
    assert queue_policy(ctx)[0] == 3
    assert queue_policy(_context(2, None))[0] == 2


def test_float_noise_does_not_add_a_replica():
    assert desired_replicas(3, 0.1, 0.1, 1, 10) == 3


def test_policy_refuses_bad_arguments():
    with pytest.raises(ValueError, match="metric"):
        LatencyTargetPolicy("latency", 1.0)
    with pytest.raises(ValueError, match="target_ttft_s"):
        LatencyTargetPolicy("ttft", 0.0)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_window_keeps_the_look_back_period():
    clock = _Clock()
    window = LatencyWindow(2.0, clock)
    assert window.mean() == 0.0
    window.add(1.0)
    clock.now += 1.0
    window.add(3.0)
    assert window.mean() == pytest.approx(2.0)
    clock.now += 1.5  # the first observation is 2.5 s old
    assert window.mean() == pytest.approx(3.0)
    clock.now += 1.0
    assert window.mean() == 0.0
    with pytest.raises(ValueError, match="window_s"):
        LatencyWindow(0.0)


class _Recorder:
    def __init__(self):
        self.calls = []

    def inc(self, name, value, labels):
        self.calls.append(("inc", name, value, dict(labels)))

    def set(self, name, value, labels):
        self.calls.append(("set", name, value, dict(labels)))

    def observe(self, name, value, labels):
        self.calls.append(("observe", name, value, dict(labels)))


def test_signals_pass_every_event_on_and_report_the_scaled_on_mean():
    sink, clock = _Recorder(), _Clock()
    signals = AutoscalingSignals(sink, "m", 5.0, "ttft", 0.5, clock)
    labels = {"model": "m"}
    signals.observe("kvray_time_to_first_token_seconds", 0.2, labels)
    signals.observe("kvray_time_to_first_token_seconds", 0.6, labels)
    signals.observe("kvray_request_queue_time_seconds", 0.1, labels)
    signals.observe("kvray_e2e_request_latency_seconds", 9.0, labels)
    signals.inc("kvray_generation_tokens", 3, labels)
    assert [c[1] for c in sink.calls] == [
        "kvray_time_to_first_token_seconds",
        "kvray_time_to_first_token_seconds",
        "kvray_request_queue_time_seconds",
        "kvray_e2e_request_latency_seconds",
        "kvray_generation_tokens",
    ]
    sink.calls.clear()
    assert signals.report() == pytest.approx({TTFT: 0.4})
    gauges = {(c[1], c[3]["signal"]): c[2] for c in sink.calls}
    assert gauges == pytest.approx(
        {
            ("kvray_autoscaling_signal_seconds", "ttft"): 0.4,
            ("kvray_autoscaling_signal_seconds", "queue_wait"): 0.1,
            ("kvray_autoscaling_target_seconds", "ttft"): 0.5,
        }
    )
    clock.now += 6.0
    assert signals.report() == {TTFT: 0.0}


def test_signals_under_ongoing_requests_report_nothing_but_keep_the_gauges():
    sink = _Recorder()
    signals = AutoscalingSignals(sink, "m", 5.0, "ongoing_requests", None, _Clock())
    signals.observe("kvray_request_queue_time_seconds", 0.3, {"model": "m"})
    sink.calls.clear()
    assert signals.report() == {}
    assert {c[3]["signal"]: c[2] for c in sink.calls} == pytest.approx(
        {"queue_wait": 0.3, "ttft": 0.0}
    )


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"autoscaling_metric": "ttft"}, "autoscaling_metric ttft needs target_ttft_s"),
        ({"target_ttft_s": 1.0}, "target_ttft_s is the target of autoscaling_metric ttft"),
        (
            {"autoscaling_metric": "ttft", "target_queue_wait_s": 1.0},
            "target_queue_wait_s is the target of autoscaling_metric queue_wait",
        ),
        (
            {
                "autoscaling_metric": "queue_wait",
                "target_queue_wait_s": 1,
                "target_ongoing_requests": 2,
            },
            "drop target_ongoing_requests",
        ),
        (
            {"autoscaling_metric": "ttft", "target_ttft_s": 1, "colocate_ingress": True},
            "colocate_ingress",
        ),
        ({"autoscaling_metric": "ttft", "target_ttft_s": 0}, "target_ttft_s"),
        ({"autoscaling_metric": "latency"}, "autoscaling_metric"),
    ],
)
def test_keys_that_do_not_go_together_are_refused(keys, message):
    with pytest.raises(ValueError, match=message):
        load_app_config({"device": "cpu", **keys})


def test_latency_metric_sets_serves_policy_and_serve_accepts_it():
    from ray.serve.config import AutoscalingConfig

    config = load_app_config(
        {"device": "cpu", "autoscaling_metric": "queue_wait", "target_queue_wait_s": 0.25}
    )
    auto = llm_server_options(config)["autoscaling_config"]
    policy = AutoscalingConfig(**auto).policy
    assert policy.policy_kwargs == {"metric": "queue_wait", "target_s": 0.25}
    built = policy.get_policy()(**policy.policy_kwargs)
    assert built(_context(1, {QUEUE: {"a": 1.0}}))[0] == 4
    default = llm_server_options(load_app_config({"device": "cpu"}))["autoscaling_config"]
    assert "policy" not in default
