"""The block ids of the pinned CPU pool (swap_space): free, held by swapped requests, or in
the prefix cache's CPU tier. Bookkeeping only; engine/core/kv_offload.py decides what goes
where, the workers hold the tensors (engine/worker/kv_swap.py)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from engine.core.block_hash import BlockHash


class CpuBlockPool:
    """The pinned pool's block ids: a free heap (lowest id first, so that one request's blocks
    come out in runs the workers copy at once), swapped requests' blocks, and the prefix tier
    (hash -> block, least recently used first)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_cpu_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks))
        self.tier: OrderedDict[bytes, tuple[BlockHash, int]] = OrderedDict()
        self.swapped: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    @property
    def tier_usage(self) -> float:
        return len(self.tier) / self.num_blocks

    def take_for_swap(self, n: int) -> list[int] | None:
        """`n` blocks for a swapped request, evicting tier blocks (LRU) as needed; None when
        even the whole tier would not make room (swapped requests hold the rest)."""
        if n > self.num_free + len(self.tier):
            return None
        while self.num_free < n:
            self._evict_tier_lru()
        return [heapq.heappop(self.free) for _ in range(n)]

    def release(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            heapq.heappush(self.free, block_id)

    def tier_lookup(self, block_hash: BlockHash) -> int | None:
        entry = self.tier.get(block_hash.value)
        if entry is None or entry[0] != block_hash:  # the whole key, tokens included
            return None
        self.tier.move_to_end(block_hash.value)
        return entry[1]

    def tier_add(self, block_hash: BlockHash) -> int | None:
        """A block for `block_hash` in the tier; None when it is there already or no block can
        be had (all held by swapped requests)."""
        if block_hash.value in self.tier:
            self.tier.move_to_end(block_hash.value)
            return None
        if not self.free:
            if not self.tier:
                return None
            self._evict_tier_lru()
        block_id = heapq.heappop(self.free)
        self.tier[block_hash.value] = (block_hash, block_id)
        return block_id

    def _evict_tier_lru(self) -> None:
        _, (_, block_id) = self.tier.popitem(last=False)
        heapq.heappush(self.free, block_id)

    def clear_tier(self) -> None:
        while self.tier:
            self._evict_tier_lru()

    def check_invariants(self) -> None:
        held = [b for ids in self.swapped.values() for b in ids]
        held += [b for _, b in self.tier.values()]
        every = held + self.free
        if sorted(every) != list(range(self.num_blocks)):
            raise AssertionError("CPU pool: free + swapped + tier != every block, once each")
