"""`PrefixAffinityRouter`: Serve's request router of LLMServer under `routing:
prefix_affinity` (cluster/deployments.py sets it on the deployment).

It runs in the process that holds the handle (the ingress) and sends a generation request
to the replica most likely to hold its prompt's start in its prefix cache
(cluster/prefix_routing.py): the longest run of the prompt's first piece names that the
replica holds, as it reported them (its Bloom filter in `record_routing_stats`, pulled by
Serve's controller every `request_routing_stats_period_s` and broadcast to the handles)
or as this router sent them there itself (known at once, before the next report).
A replica above its share of the load by more than `load_factor` does not get it: the
request then goes by power of two choices, as it does when no replica holds its prefix.

Serve pickles this module by value when the deployment is built; what it imports
(cluster.prefix_routing, engine) is imported in the handle's process.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.prefix_routing import (
    ROUTING_STATS_KEY,
    Candidate,
    PrefixSketch,
    bloom_contains,
    choose_by_affinity,
    matched_blocks,
    served_prefix_keys,
)

DECISIONS_METRIC = "kvray_routing_decisions"
_KEYS_ATTR = "_kvray_prefix_keys"


def pending_request_keys(pending: PendingRequest | None, block_size: int) -> list[int] | None:
    """The prefix names of an LLMServer.generate call (args: kind, request, context); None
    for any other call (stats, tokenize), routed by load."""
    if pending is None or len(pending.args) != 3 or pending.metadata.call_method != "generate":
        return None
    return served_prefix_keys(*pending.args, block_size)


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(
        self, block_size: int = 16, load_factor: float = 1.5, model: str = "", **_: Any
    ) -> None:
        self.block_size = block_size
        self.load_factor = load_factor
        self.model = model
        self.sent: dict[Any, PrefixSketch] = {}
        """Per replica id: the names of the prompts this router sent there."""
        self.decisions: Counter[str] = Counter()
        self._metric: Any = None

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # One round over all replicas, then Serve's backoff before the next.
            pending_request.routing_context.should_backoff = True
        if len(candidate_replicas) <= 1:
            return [candidate_replicas]
        return self.rank(candidate_replicas, pending_request)

    def rank(
        self, replicas: list[RunningReplica], pending: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """[[the affinity replica], two random ones] or [two random ones]."""
        # In random order: Serve takes the first of equally loaded replicas.
        fallback = random.sample(replicas, 2)
        # Hashed once per request; Serve calls again after a backoff.
        first_round = pending is not None and not hasattr(pending, _KEYS_ATTR)
        if first_round:
            setattr(pending, _KEYS_ATTR, pending_request_keys(pending, self.block_size))
        keys = getattr(pending, _KEYS_ATTR, None)
        if keys is None:
            return [fallback]
        target, decision = choose_by_affinity(
            [self._candidate(r, keys) for r in replicas], self.load_factor
        )
        if first_round:  # counted once per request, not per retry
            self._count(decision)
        return [fallback] if target is None else [[target], fallback]

    def _candidate(self, replica: RunningReplica, keys: list[int]) -> Candidate:
        sent = self.sent.get(replica.replica_id)
        matched = 0 if sent is None else matched_blocks(keys, sent.__contains__)
        bloom = (replica.routing_stats or {}).get(ROUTING_STATS_KEY)
        if bloom and matched < len(keys):
            matched = max(matched, matched_blocks(keys, lambda k: bloom_contains(bloom, k)))
        load = self._replica_queue_len_cache.get(replica.replica_id) or 0
        return Candidate(replica, load, matched)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result) -> None:
        keys = getattr(pending_request, _KEYS_ATTR, None)
        if keys:
            self.sent.setdefault(replica_id, PrefixSketch()).add(keys)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [rid for rid in self.sent if rid not in live]:
            del self.sent[gone]

    def _count(self, decision: str) -> None:
        self.decisions[decision] += 1
        if self._metric is False:
            return
        try:
            if self._metric is None:
                from ray.serve import metrics

                from engine.observability.metrics import METRICS_BY_NAME

                spec = METRICS_BY_NAME[DECISIONS_METRIC]
                self._metric = metrics.Counter(spec.name, spec.description, tag_keys=spec.labels)
            self._metric.inc(1, tags={"model": self.model, "decision": decision})
        except Exception:  # metrics never fail a request's routing
            self._metric = False
