"""The paged KV cache's blocks: `KVCacheBlock`, the LRU free queue threaded through them,
and `BlockPool`, which hands blocks out, frees them and keeps the prefix cache's hash map.

Only ids and counts live here; the KV tensors themselves belong to the workers. Block 0 is
the null block: it pads block tables and is never handed to a request. Requests' blocks,
prefix hits and forks are kv_cache.py's `KVCacheManager`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from engine.core.block_hash import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        """Set while the block is registered in the prefix cache (in use or free)."""
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={cached})"


class FreeKVCacheBlockQueue:
    """Doubly linked list threaded through the blocks themselves.

    Allocation pops from the head and freeing appends at the tail, so among free blocks that
    still hold cached KV the head is the least recently freed: the list is also the LRU
    eviction order. A prefix hit on a free block unlinks it from the middle in O(1).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free_block
        while block is not self._tail:
            yield block
            block = block.next_free_block

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free_block is not None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.evict_listener: Callable[[KVCacheBlock], None] | None = None
        """Called with each cached block just before it is reused (its KV still intact):
        the CPU tier of the prefix cache (engine/core/kv_offload.py) keeps a copy."""

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones, cached or not (cached are evictable)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        block = self.cached_block_hash_to_block.get(block_hash.value)
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} are free"
            )
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None and self.evict_listener is not None:
                self.evict_listener(block)
            self.uncache_block(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def uncache_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_block_hash_to_block[block.block_hash.value]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Register full blocks whose KV is computed so later requests can reuse them."""
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None:
                continue
            # Two requests computed the same block before either was cached: keep the first,
            # the duplicate stays private to its request and is reused as a plain free block.
            if block_hash.value in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash.value] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue tail in the given order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def check_invariants(self) -> None:
        free = list(self.free_block_queue)
        free_ids = {b.block_id for b in free}
        check_invariant(len(free) == len(free_ids), "a block is in the free queue twice")
        check_invariant(len(free) == self.free_block_queue.num_free_blocks, "free count is stale")
        null = self.null_block
        check_invariant(
            null.block_id not in free_ids and null.ref_cnt == 0 and null.block_hash is None,
            "the null block was handed out or cached",
        )
        num_in_use = num_cached_free = num_free = 0
        for block in self.blocks[1:]:
            is_free = block.block_id in free_ids
            check_invariant(
                block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            )
            check_invariant(
                is_free == (block.ref_cnt == 0),
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue: {is_free}",
            )
            if block.block_hash is not None:
                check_invariant(
                    self.cached_block_hash_to_block.get(block.block_hash.value) is block,
                    f"block {block.block_id} has a hash the cache map does not point back to",
                )
            if not is_free:
                num_in_use += 1
            elif block.block_hash is not None:
                num_cached_free += 1
            else:
                num_free += 1
        for value, block in self.cached_block_hash_to_block.items():
            check_invariant(
                block.block_hash is not None and block.block_hash.value == value,
                f"cache map entry for block {block.block_id} does not match its hash",
            )
        check_invariant(
            self.enable_caching or not self.cached_block_hash_to_block, "caching is off"
        )
        check_invariant(
            num_in_use + num_cached_free + num_free == self.num_usable_blocks,
            "free + in use + cached != total",
        )


def check_invariant(condition: bool, message: str) -> None:
    # Not `assert`: these checks must survive `python -O`.
    if not condition:
        raise AssertionError(message)


def cdiv(a: int, b: int) -> int:
    return -(a // -b)
