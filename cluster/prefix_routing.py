"""Cache-aware routing without Ray: what a request's prefix is called, what a replica
remembers of the prefixes it served, and which replica a request should go to.

Prompts are tokenized in the replica (cluster/engine_host.py), so the router sees text (or
token ids where the client sent them). It names a prompt's start by chained hashes of
fixed-size pieces, computed by the engine's own block hash (engine/core/block_hash.py) with
the request's prefix-cache salt in the first piece: two tenants' identical prompts never
share a name, and two prompts share their first k names exactly when their first k pieces
are the same. A text piece is `TEXT_CHARS_PER_TOKEN` x block_size characters, about a KV
block's worth of text; a prompt of token ids is cut into block_size ids, as the engine
cuts it. A prompt's start in text is thus an approximation of its KV blocks: two prompts
that share their first pieces share about that many tokens' blocks in the engine.

A replica keeps the names of the prompts it served lately (`PrefixSketch`, a bounded LRU)
and reports them as a Bloom filter (`bloom_of`), a few KiB however long the prompts.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.core.block_hash import hash_block_tokens
from engine.tenants import prefix_cache_salt

TEXT_CHARS_PER_TOKEN = 4
"""Characters of prompt text taken as one token's worth when text is cut into pieces."""
ROUTING_BLOCKS = 32
"""A request's first this many pieces are compared with the replicas' (the start of a
prompt is what a prefix cache shares; further pieces add hashing, not information)."""
SKETCH_CAPACITY = 8192
"""Piece names a replica (and the router, per replica) remembers, newest kept."""
BLOOM_BITS = 1 << 17
BLOOM_PROBES = 4
"""16 KiB and 4 probes: about 0.2% false positives at SKETCH_CAPACITY names."""
ROUTING_STATS_KEY = "prefix_bloom"
"""The key of a replica's routing stats (record_routing_stats) that holds its filter."""


def _prompt_of_completion(prompt: Any) -> str | Sequence[int] | None:
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        return None
    first = prompt[0]
    if isinstance(first, int):
        return prompt
    return _prompt_of_completion(first)  # several prompts: the first one's start


def _chat_text(request: Any) -> str:
    """A chat's messages (and tools, which templates put first) as one text: the same
    messages give the same text, a chat that continues another starts with its text."""
    parts = []
    tools = getattr(request, "tools", None)
    if tools:
        parts.append("".join(t.model_dump_json() for t in tools))
    for message in request.messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(getattr(part, "text", "") or "" for part in content)
        parts.append(f"\x1e{message.role}\x1f{content or ''}")
    return "".join(parts)


def request_prompt(kind: str, request: Any) -> str | Sequence[int] | None:
    """The prompt of a generation request as the ingress sends it to a replica: text, token
    ids, or None when there is none to compare (the request is then routed by load)."""
    if kind == "chat":
        return _chat_text(request) if getattr(request, "messages", None) else None
    return _prompt_of_completion(getattr(request, "prompt", None))


def prefix_keys(
    prompt: str | Sequence[int] | None,
    salt: str | None,
    block_size: int,
    max_blocks: int = ROUTING_BLOCKS,
) -> list[int]:
    """The names (64-bit ints) of `prompt`'s first full pieces, at most `max_blocks`."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if not prompt:
        return []
    text = isinstance(prompt, str)
    size = block_size * TEXT_CHARS_PER_TOKEN if text else block_size
    count = min(len(prompt) // size, max_blocks)
    keys = []
    parent = None
    for i in range(count):
        piece = prompt[i * size : (i + 1) * size]
        # A text piece goes in as one "token" (its string): hashing stays cheap.
        tokens = (piece,) if text else piece
        extra = ("text" if text else "ids", salt) if parent is None else ()
        parent = hash_block_tokens(parent, tokens, extra)
        keys.append(int.from_bytes(parent.value[:8], "little"))
    return keys


def request_prefix_keys(
    kind: str, request: Any, tenant_salt: str | None, block_size: int
) -> list[int]:
    """`prefix_keys` of a generation request, salted as the engine salts its blocks."""
    salt = prefix_cache_salt(tenant_salt, getattr(request, "cache_salt", None))
    return prefix_keys(request_prompt(kind, request), salt, block_size)


def served_prefix_keys(kind: str, request: Any, ctx: Any, block_size: int) -> list[int]:
    """`request_prefix_keys` of a call's (kind, request, context); none for a request of
    another shape: routing never fails a request."""
    try:
        return request_prefix_keys(kind, request, getattr(ctx, "cache_salt", None), block_size)
    except (AttributeError, TypeError):
        return []


class PrefixSketch:
    """The newest `capacity` piece names seen (a bounded LRU set), and a Bloom filter of
    them kept up to date as names come (a name evicted stays in the filter until a quarter
    of the capacity has been evicted; then the filter is rebuilt from the names held)."""

    def __init__(self, capacity: int = SKETCH_CAPACITY, bits: int = BLOOM_BITS) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.bits = bits
        self._keys: OrderedDict[int, None] = OrderedDict()
        self._table = bytearray(bits // 8)
        self._evicted = 0

    def add(self, keys: Iterable[int]) -> None:
        for key in keys:
            if key in self._keys:
                self._keys.move_to_end(key)
                continue
            self._keys[key] = None
            _set_bits(self._table, key, self.bits)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
            self._evicted += 1

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[int]:
        return list(self._keys)

    def bloom(self) -> bytes:
        """The filter of the names held (and of at most capacity / 4 evicted ones)."""
        if self._evicted > self.capacity // 4:
            self._table = bytearray(bloom_of(self._keys, self.bits))
            self._evicted = 0
        return bytes(self._table)


def _probes(key: int, bits: int) -> Iterable[int]:
    # Double hashing of the 64-bit name (itself a slice of a SHA-256 digest).
    low, high = key & 0xFFFFFFFF, (key >> 32) | 1
    return ((low + i * high) % bits for i in range(BLOOM_PROBES))


def bloom_of(keys: Iterable[int], bits: int = BLOOM_BITS) -> bytes:
    """A Bloom filter of `keys` (`bits` bits, a multiple of 8)."""
    table = bytearray(bits // 8)
    for key in keys:
        _set_bits(table, key, bits)
    return bytes(table)


def _set_bits(table: bytearray, key: int, bits: int) -> None:
    for p in _probes(key, bits):
        table[p >> 3] |= 1 << (p & 7)


def bloom_contains(table: bytes, key: int) -> bool:
    bits = len(table) * 8
    return bits > 0 and all(table[p >> 3] >> (p & 7) & 1 for p in _probes(key, bits))


def matched_blocks(keys: Sequence[int], holds: Callable[[int], bool]) -> int:
    """How many of `keys`, from the first, `holds` has: names are chained, so a replica
    that lacks piece i cannot hold a cached piece i+1 of the same prompt."""
    n = 0
    for key in keys:
        if not holds(key):
            break
        n += 1
    return n


@dataclass(frozen=True)
class Candidate:
    replica: Any
    load: int
    """Requests the replica holds (running and queued), as far as the router knows."""
    matched: int
    """Leading pieces of the request's prompt the replica is known to hold."""


AFFINITY, NO_MATCH, OVER_BOUND = "affinity", "no_match", "over_bound"
"""The router's decisions: sent where the prefix is; no replica holds it (load decides);
the replicas that hold it are above the load bound (load decides)."""


def load_bound(loads: Sequence[int], load_factor: float) -> int:
    """The most requests (this one included) a replica may hold to take a request for its
    prefix: load_factor x the mean with this request added, rounded up."""
    return math.ceil(load_factor * (sum(loads) + 1) / len(loads))


def choose_by_affinity(candidates: Sequence[Candidate], load_factor: float) -> tuple[Any, str]:
    """(the replica to send to, or None for the load-based fallback; the decision).

    The replica holding the longest start of the prompt wins (the less loaded among equals),
    unless taking the request would put it above `load_bound`; then the next best one.
    """
    if load_factor < 1:
        raise ValueError(f"load_factor must be >= 1, got {load_factor}")
    matching = [c for c in candidates if c.matched > 0]
    if not matching:
        return None, NO_MATCH
    bound = load_bound([c.load for c in candidates], load_factor)
    for c in sorted(matching, key=lambda c: (-c.matched, c.load)):
        if c.load + 1 <= bound:
            return c.replica, AFFINITY
    return None, OVER_BOUND
