"""Cache-aware routing end to end: one app, the bundled model twice (dummy weights, two
replicas each), one model under prefix_affinity and one under power_of_two, the same
workload of shared-prefix groups sent to each. Prompts are token ids (dummy weights come
without a tokenizer): the router cuts them into KV blocks as the engine does; the text
form's pieces are checked in tests/unit/test_prefix_routing.py.

Counted, not timed: a request whose prompt's start another request of its group already
put in some replica's prefix cache is "cold" when it finds none of it cached (it went to
the other replica). Under prefix_affinity none is; under power_of_two about half of the
groups' later requests land on the replica that has not seen the group. Mean latencies
(max_tokens 1: the time to the first token) are printed beside the counts.
"""

from __future__ import annotations

import concurrent.futures
import random
import time

import httpx
import pytest

from tests.support.serve_apps import served_app

APP = "routing"
AFFINITY, P2C = "smol-affinity", "smol-p2c"
REPLICA_KEYS = {
    "load_format": "dummy",
    "min_replicas": 2,
    "max_replicas": 2,
    "num_cpus": 0.125,
    "max_model_len": 256,
    "max_num_seqs": 8,
    "enable_prompt_tokens_details": True,
}
ARGS = {
    "models": [
        {"served_model_name": AFFINITY, "routing": "prefix_affinity", **REPLICA_KEYS},
        {"served_model_name": P2C, "routing": "power_of_two", **REPLICA_KEYS},
    ],
    "ingress_max_replicas": 1,
}
GROUPS, PER_GROUP = 6, 4
BLOCK = 16  # the engine's default block_size


@pytest.fixture(scope="module")
def url():
    with served_app(APP, ARGS) as base_url:
        yield base_url


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 5000) for _ in range(n)]


def _complete(url: str, model: str, prompt: list[int]) -> tuple[int, int, float]:
    """(prompt tokens, of them cached, seconds to the answer)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    elapsed = time.perf_counter() - start
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return usage["prompt_tokens"], cached, elapsed


def _run_workload(url: str, model: str, seed: int) -> dict:
    """Each group's first request alone, then the rest in random order, two at a time."""
    rng = random.Random(seed)
    prefixes = [_ids(rng, 5 * BLOCK) for _ in range(GROUPS)]
    for prefix in prefixes:
        _complete(url, model, prefix + _ids(rng, 4))
    later = [p + _ids(rng, 4) for p in prefixes for _ in range(PER_GROUP - 1)]
    rng.shuffle(later)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda p: _complete(url, model, p), later))
    prompt = sum(r[0] for r in results)
    cached = sum(r[1] for r in results)
    return {
        "cold": sum(1 for r in results if r[1] == 0),
        "hit_rate": cached / prompt,
        "mean_s": sum(r[2] for r in results) / len(results),
    }


def test_prefix_affinity_keeps_groups_on_their_replica_and_load_spills_past_the_bound(url):
    affinity = _run_workload(url, AFFINITY, seed=1)
    p2c = _run_workload(url, P2C, seed=2)
    print(f"\nprefix_affinity {affinity}\npower_of_two    {p2c}")
    assert affinity["cold"] == 0, affinity
    assert p2c["cold"] >= 1, p2c
    assert affinity["hit_rate"] > p2c["hit_rate"]

    # Eight of one warm group at once: above its share (routing_load_factor 1.5 of the
    # mean), the warm replica gives requests up to the other one, where they find no cache.
    rng = random.Random(3)
    prefix = _ids(rng, 5 * BLOCK)
    _complete(url, AFFINITY, prefix + _ids(rng, 4))
    burst = [prefix + _ids(rng, 4) for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: _complete(url, AFFINITY, p), burst))
    spilled = sum(1 for r in results if r[1] == 0)
    assert 1 <= spilled < len(burst), results
