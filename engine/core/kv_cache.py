"""Paged KV-cache bookkeeping: each request's blocks from the block pool (block_pool.py),
prefix caching, forks.

Only ids and counts live here; the KV tensors themselves belong to the workers.

A block's `ref_cnt` is the number of requests that hold it: a prefix hit or a fork (n > 1
samples, beams) takes one more reference, and a block returns to the free queue only when
its last holder frees it. A request never writes into a block another request holds: the
first write into a shared block copies it (copy-on-write), and the copies to make reach
the workers as `block_copies`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.core.block_hash import hash_block_tokens
from engine.core.block_pool import BlockPool, KVCacheBlock, cdiv, check_invariant
from engine.core.request import Request


class KVCacheManager:
    """Maps requests to blocks: prefix hits at admission, slots as tokens grow, frees at the end.

    A request's blocks cover its computed tokens plus the ones scheduled this step:

        |<-------- num_computed_tokens -------->|<--- num_new_tokens --->|
        [ block 0 ][ block 1 ][ block 2 ][ block 3 ][ block 4 ][ block 5 ][ bl
        |<-- prefix hits -->|                   |<-- allocated now, full ones cached -->|

    Full blocks are registered as soon as they are scheduled, so a request admitted later in
    the same step shares them: every layer writes the whole batch's KV before attending. If
    the step never runs them (preempted in the same schedule), free() unregisters them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        """request id -> how many of its leading blocks are registered in the prefix cache."""
        self.prefix_cache_queries = 0
        """Tokens of the requests admitted so far (resumed ones again), as vLLM counts them."""
        self.prefix_cache_hits = 0
        """Of those, tokens served from the prefix cache."""
        self.block_copies: list[tuple[int, int]] = []
        """(source, destination) block ids the workers copy before the next forward: the
        copy-on-write of shared blocks. The scheduler takes them with each step."""

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def max_num_tokens(self) -> int:
        """Tokens the whole cache holds: the most KV one request can ever have."""
        return self.block_pool.num_usable_blocks * self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, and its length in tokens.

        Never the whole request: the last token is recomputed so its logits sample the next.
        None for a request that wants its prompt's logprobs: a cached token has no logits.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; the ids of the newly allocated blocks.

        `new_computed_blocks` are the prefix hits of a request being admitted. None (and no
        change at all) when the free blocks do not suffice.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id, [])
        if new_computed_blocks and req_blocks:
            raise ValueError(f"request {req_id} already has blocks; prefix hits are for admission")
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # Blocks this step writes into that another request holds too (a fork's last,
        # partial block): each is copied into a block of the request's own first.
        shared = [
            i
            for i in range(num_computed // self.block_size, len(req_blocks))
            if req_blocks[i].ref_cnt > 1
        ]
        # Hits on free cached blocks leave the free queue, so they cannot also be handed out.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + len(shared) > self.num_free_blocks - num_free_hits:
            return None
        for i in shared:
            self._copy_on_write(req_blocks, i)

        if req_id not in self.req_to_blocks:
            self.req_to_blocks[req_id] = req_blocks
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(new_computed_blocks) * self.block_size
                self.num_cached_blocks[req_id] = len(new_computed_blocks)
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        self.cache_blocks(request, num_computed + num_new_tokens)
        return [b.block_id for b in new_blocks]

    def _copy_on_write(self, req_blocks: list[KVCacheBlock], index: int) -> None:
        shared = req_blocks[index]
        (own,) = self.block_pool.get_new_blocks(1)
        req_blocks[index] = own
        self.block_pool.free_blocks([shared])  # others still hold it: stays in use
        self.block_copies.append((shared.block_id, own.block_id))

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Let `child` share the blocks that hold `parent`'s first `num_tokens` tokens.

        The two must have those tokens in common, and their KV must be computed (scheduled
        by a step already launched): the child's `num_computed_tokens` becomes
        `num_tokens`. Each shared block takes one more reference; the last one, if
        partial, is copied when either of them next writes into it (allocate_slots).
        """
        parent_id, child_id = parent.request_id, child.request_id
        blocks = self.req_to_blocks.get(parent_id)
        if blocks is None:
            raise ValueError(f"request {parent_id} holds no blocks to fork")
        if child_id in self.req_to_blocks:
            raise ValueError(f"request {child_id} already has blocks; only a new one forks")
        if not 0 <= num_tokens <= parent.num_computed_tokens:
            raise ValueError(
                f"num_tokens must be in [0, {parent.num_computed_tokens}] (the parent's "
                f"computed tokens), got {num_tokens}"
            )
        shared = blocks[: cdiv(num_tokens, self.block_size)]
        for block in shared:
            block.ref_cnt += 1  # held by the parent: never in the free queue
        self.req_to_blocks[child_id] = list(shared)
        num_full = num_tokens // self.block_size
        child.block_hashes = list(parent.block_hashes[:num_full])
        if self.enable_caching:
            self.num_cached_blocks[child_id] = min(
                self.num_cached_blocks.get(parent_id, 0), num_full
            )
        child.num_computed_tokens = num_tokens

    def num_shared_blocks(self) -> int:
        """Blocks held by more than one request."""
        return sum(1 for b in self.block_pool.blocks[1:] if b.ref_cnt > 1)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks within its first `num_tokens` tokens."""
        if not self.enable_caching or request.request_id not in self.req_to_blocks:
            return
        req_id = request.request_id
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_cached = self.num_cached_blocks.get(req_id, 0)
        if num_full <= num_cached:
            return
        self._update_block_hashes(request)
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[req_id][num_cached:num_full],
            request.block_hashes[num_cached:num_full],
        )
        self.num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks; its computed full blocks stay cached until evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        num_cached = self.num_cached_blocks.pop(request.request_id, 0)
        if blocks is None:
            return
        if self.block_copies:
            # A copy into a block of its own that this step never gets to use.
            own = {b.block_id for b in blocks}
            self.block_copies = [(s, d) for s, d in self.block_copies if d not in own]
        # Registered for tokens the step in flight was to compute, but it never will.
        for block in blocks[request.num_computed_tokens // self.block_size : num_cached]:
            self.block_pool.uncache_block(block)
        # Tail first: the end of a prompt is the least likely part to be shared, so it is
        # evicted before the head.
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.block_pool.check_invariants()
        refs = Counter(b.block_id for blocks in self.req_to_blocks.values() for b in blocks)
        check_invariant(0 not in refs, "a request holds the null block")
        for block in self.block_pool.blocks[1:]:
            check_invariant(
                block.ref_cnt == refs.get(block.block_id, 0),
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                f"held by {refs.get(block.block_id, 0)} request(s)",
            )
        for src, dst in self.block_copies:
            check_invariant(
                refs.get(src, 0) >= 1 and refs.get(dst, 0) == 1,
                f"block copy {src} -> {dst}: the source must be held, the copy by one request",
            )

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self.block_copies = self.block_copies, []
        return copies

    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        extra_keys = () if request.cache_salt is None else (request.cache_salt,)
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra_keys))
