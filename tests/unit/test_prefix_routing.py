"""Cache-aware routing without Ray: prompt names, replicas' sketches, the choice and its
load bound (cluster/prefix_routing.py), and the Serve router's ranking
(cluster/prefix_router.py) on stand-in replicas."""

from __future__ import annotations

import random
import statistics
import time
from types import SimpleNamespace

import pytest

from cluster import prefix_router
from cluster.prefix_router import PrefixAffinityRouter
from cluster.prefix_routing import (
    AFFINITY,
    NO_MATCH,
    OVER_BOUND,
    ROUTING_BLOCKS,
    ROUTING_STATS_KEY,
    SKETCH_CAPACITY,
    TEXT_CHARS_PER_TOKEN,
    Candidate,
    PrefixSketch,
    bloom_contains,
    bloom_of,
    choose_by_affinity,
    load_bound,
    matched_blocks,
    prefix_keys,
    request_prefix_keys,
    served_prefix_keys,
)
from engine.api.protocol import ChatCompletionRequest, CompletionRequest

PIECE = 16 * TEXT_CHARS_PER_TOKEN  # characters per piece at block_size 16


def _text(seed: int, pieces: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefgh ") for _ in range(pieces * PIECE))


def test_prompts_sharing_a_start_share_its_leading_names_only():
    shared = _text(0, 3)
    a = prefix_keys(shared + _text(1, 2), None, 16)
    b = prefix_keys(shared + _text(2, 2), None, 16)
    assert len(a) == len(b) == 5
    assert a[:3] == b[:3]
    assert not set(a[3:]) & set(b[3:])
    assert prefix_keys(shared + _text(1, 2), None, 16) == a  # deterministic


def test_names_count_full_pieces_up_to_the_cap():
    assert prefix_keys("x" * (PIECE - 1), None, 16) == []
    assert len(prefix_keys("x" * (2 * PIECE + 5), None, 16)) == 2
    assert len(prefix_keys(_text(3, ROUTING_BLOCKS + 4), None, 16)) == ROUTING_BLOCKS
    assert len(prefix_keys(list(range(40)), None, 16)) == 2  # token ids: block_size ids
    with pytest.raises(ValueError, match="block_size"):
        prefix_keys("abc", None, 0)


def test_salts_and_prompt_forms_never_share_names():
    text = _text(4, 2)
    plain = prefix_keys(text, None, 16)
    assert not set(plain) & set(prefix_keys(text, "tenant-a", 16))
    assert not set(prefix_keys(text, "tenant-a", 16)) & set(prefix_keys(text, "tenant-b", 16))
    ids = list(range(32))
    assert not set(prefix_keys(ids, None, 16)) & set(prefix_keys("".join(map(chr, ids)), None, 16))


def test_request_names_follow_the_engines_salt_and_the_prompt_form():
    text = _text(5, 2)
    completion = CompletionRequest(model="m", prompt=text)
    assert request_prefix_keys("completion", completion, None, 16) == prefix_keys(text, None, 16)
    several = CompletionRequest(model="m", prompt=[text, "other"])
    assert request_prefix_keys("completion", several, None, 16) == prefix_keys(text, None, 16)
    own_salt = CompletionRequest(model="m", prompt=text, cache_salt="mine")
    with_own_salt = request_prefix_keys("completion", own_salt, "t", 16)
    assert with_own_salt != request_prefix_keys("completion", completion, "t", 16)
    # A call of another shape is routed by load, never failed.
    assert served_prefix_keys("completion", SimpleNamespace(prompt=3), None, 16) == []
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": text}])
    longer = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "user", "content": text},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": _text(6, 1)},
        ],
    )
    short, long = (request_prefix_keys("chat", r, None, 16) for r in (chat, longer))
    assert short and long[: len(short)] == short  # a conversation continues its start


def test_sketch_keeps_the_newest_names_and_its_bloom_holds_them():
    sketch = PrefixSketch(capacity=4)
    sketch.add([1, 2, 3, 4])
    sketch.add([1, 5])  # 1 refreshed, 2 the oldest: evicted
    assert sketch.keys() == [3, 4, 1, 5]
    assert all(bloom_contains(sketch.bloom(), k) for k in (3, 4, 1, 5))
    assert sketch.bloom() == bloom_of([1, 2, 3, 4, 5])  # one eviction: kept in the filter
    sketch.add([6, 7])  # more than a quarter of the capacity evicted: rebuilt
    assert sketch.keys() == [1, 5, 6, 7]
    assert sketch.bloom() == bloom_of([1, 5, 6, 7])
    with pytest.raises(ValueError, match="capacity"):
        PrefixSketch(0)


def test_bloom_false_positives_are_rare_at_capacity():
    rng = random.Random(7)
    held = [rng.getrandbits(64) for _ in range(SKETCH_CAPACITY)]
    bloom = bloom_of(held)
    others = [rng.getrandbits(64) for _ in range(20_000)]
    false_hits = sum(bloom_contains(bloom, k) for k in others)
    assert false_hits < 0.01 * len(others)
    assert not bloom_contains(b"", 1)


def test_match_counts_leading_names_only():
    assert matched_blocks([1, 2, 3], {1, 2, 3}.__contains__) == 3
    assert matched_blocks([1, 2, 3], {1, 3}.__contains__) == 1
    assert matched_blocks([1, 2, 3], {2, 3}.__contains__) == 0


def test_longest_match_wins_within_the_load_bound():
    a, b, c = (Candidate(n, load, m) for n, load, m in (("a", 0, 2), ("b", 0, 5), ("c", 0, 0)))
    assert choose_by_affinity([a, b, c], 1.5) == ("b", AFFINITY)
    tied = [Candidate("x", 2, 3), Candidate("y", 1, 3)]
    assert choose_by_affinity(tied, 2.0) == ("y", AFFINITY)  # equals: the less loaded
    assert choose_by_affinity([c, Candidate("d", 0, 0)], 1.5) == (None, NO_MATCH)


def test_a_loaded_replica_gives_way_to_the_next_match_or_to_load():
    # Two replicas, 3 requests on the match: its share with this one is ceil(1.5 * 4 / 2) = 3.
    assert load_bound([3, 0], 1.5) == 3
    assert choose_by_affinity([Candidate("a", 3, 4), Candidate("b", 0, 0)], 1.5) == (
        None,
        OVER_BOUND,
    )
    assert choose_by_affinity([Candidate("a", 2, 4), Candidate("b", 0, 0)], 1.5)[0] == "a"
    three = [Candidate("a", 5, 4), Candidate("b", 1, 2), Candidate("c", 0, 0)]
    assert choose_by_affinity(three, 1.5) == ("b", AFFINITY)
    with pytest.raises(ValueError, match="load_factor"):
        choose_by_affinity(three, 0.5)


class _QueueLens(dict):
    def get(self, replica_id):  # ReplicaQueueLengthCache.get
        return super().get(replica_id)


def _router(load_factor: float = 1.5) -> PrefixAffinityRouter:
    # The ranking needs none of RequestRouter's Serve state but the queue-length cache.
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
    router.initialize_state(block_size=16, load_factor=load_factor, model="m")
    router._replica_queue_len_cache = _QueueLens()
    router._metric = False  # no Ray metrics here
    return router


def _replica(name: str, bloom: bytes | None = None) -> SimpleNamespace:
    stats = {} if bloom is None else {ROUTING_STATS_KEY: bloom}
    return SimpleNamespace(replica_id=name, routing_stats=stats)


def _pending(prompt: str, salt: str | None = None, method: str = "generate"):
    request = CompletionRequest(model="m", prompt=prompt, max_tokens=1)
    return SimpleNamespace(
        args=["completion", request, SimpleNamespace(cache_salt=salt)],
        metadata=SimpleNamespace(call_method=method),
        routing_context=SimpleNamespace(should_backoff=False),
    )


def test_router_sends_a_prompt_where_it_sent_its_start():
    router, replicas = _router(), [_replica("r0"), _replica("r1")]
    shared = _text(8, 4)
    first = _pending(shared + _text(9, 1))
    ranks = router.rank(replicas, first)
    assert len(ranks) == 1 and set(r.replica_id for r in ranks[0]) == {"r0", "r1"}
    router.on_request_routed(first, "r1", None)
    ranks = router.rank(replicas, _pending(shared + _text(10, 1)))
    assert [r.replica_id for r in ranks[0]] == ["r1"]
    # Another tenant's identical prompt is no match.
    assert len(router.rank(replicas, _pending(shared, salt="other"))) == 1
    assert router.decisions == {NO_MATCH: 2, AFFINITY: 1}


def test_router_reads_replicas_reported_prefixes_and_respects_the_bound():
    prompt = _text(11, 3)
    reported = bloom_of(prefix_keys(prompt, None, 16))
    router, replicas = _router(), [_replica("r0"), _replica("r1", reported)]
    assert [r.replica_id for r in router.rank(replicas, _pending(prompt))[0]] == ["r1"]
    router._replica_queue_len_cache.update(r1=3, r0=0)
    assert len(router.rank(replicas, _pending(prompt))) == 1  # over the bound: by load
    assert router.decisions == {AFFINITY: 1, OVER_BOUND: 1}


def test_router_routes_other_calls_and_one_replica_without_hashing(monkeypatch):
    calls = []
    real = prefix_router.served_prefix_keys
    monkeypatch.setattr(prefix_router, "served_prefix_keys", lambda *a: calls.append(a) or real(*a))
    router, one = _router(), [_replica("r0")]
    pending = _pending(_text(12, 4))
    assert asyncio_run(router.choose_replicas(one, pending)) == [one]
    assert pending.routing_context.should_backoff
    two = [_replica("r0"), _replica("r1")]
    assert len(router.rank(two, _pending(_text(12, 4), method="stats"))) == 1
    assert calls == [] and not router.decisions


def asyncio_run(coro):
    import asyncio

    return asyncio.run(coro)


def test_router_choice_is_cheap():
    """The router's own time per request (hashing 32 pieces, matching 4 replicas): a small
    fraction of a prefill; the median over many, so a busy machine does not fail it."""
    router = _router()
    held = range(0, SKETCH_CAPACITY * 8, 8)
    replicas = [_replica(f"r{i}", bloom_of(k + i for k in held)) for i in range(4)]
    prompts = [_text(100 + i % 8, ROUTING_BLOCKS + 2) for i in range(200)]
    times = []
    for prompt in prompts:
        pending = _pending(prompt)
        start = time.perf_counter()
        router.rank(replicas, pending)
        times.append(time.perf_counter() - start)
        router.on_request_routed(pending, replicas[len(times) % 4].replica_id, None)
    assert statistics.median(times) < 0.005
