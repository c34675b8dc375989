"""BlockPool and KVCacheManager: allocation, prefix caching, eviction order, invariants."""

from __future__ import annotations

import pytest

import engine.core.kv_cache as kv_cache
from engine.core.block_hash import BlockHash
from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


class CheckedKVCacheManager(KVCacheManager):
    """Checks every invariant after each operation that changes state."""

    def allocate_slots(self, *args, **kwargs):
        result = super().allocate_slots(*args, **kwargs)
        self.check_invariants()
        return result

    def free(self, request):
        super().free(request)
        self.check_invariants()


def make_manager(num_blocks: int = 11, enable_caching: bool = True) -> CheckedKVCacheManager:
    manager = CheckedKVCacheManager(num_blocks, BLOCK_SIZE, enable_caching)
    manager.check_invariants()
    return manager


def make_request(
    request_id: str, prompt_token_ids: list[int], cache_salt: str | None = None
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=SamplingParams(max_tokens=8),
        eos_token_id=None,
        cache_salt=cache_salt,
    )


def compute(manager: KVCacheManager, request: Request, num_tokens: int | None = None) -> None:
    """Admit `request` with its prefix hits and compute `num_tokens` (default: all) tokens."""
    blocks, num_hit = manager.get_computed_blocks(request)
    num_new = (request.num_tokens if num_tokens is None else num_tokens) - num_hit
    assert manager.allocate_slots(request, num_new, blocks) is not None
    request.num_computed_tokens = num_hit + num_new


def cached_flags(manager: KVCacheManager, request: Request) -> list[bool]:
    """For each full block of `request`, whether its KV is still in the prefix cache."""
    return [manager.block_pool.get_cached_block(h) is not None for h in request.block_hashes]


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_allocate_and_free():
    manager = make_manager(num_blocks=11)
    request = make_request("a", tokens(0, 10))
    block_ids = manager.allocate_slots(request, 10)
    assert len(block_ids) == 3 and len(set(block_ids)) == 3
    assert 0 not in block_ids
    assert manager.get_block_ids(request) == block_ids
    assert manager.usage == pytest.approx(3 / 10)

    # Growing within the last block needs nothing; crossing into a new one takes one block.
    request.num_computed_tokens = 10
    assert manager.allocate_slots(request, 2) == []
    request.num_computed_tokens = 12
    assert len(manager.allocate_slots(request, 1)) == 1

    manager.free(request)
    assert manager.usage == 0
    assert manager.get_block_ids(request) == []
    assert manager.num_free_blocks == 10


def test_null_block_is_never_handed_out():
    manager = make_manager(num_blocks=6)
    request = make_request("a", tokens(0, 20))
    assert sorted(manager.allocate_slots(request, 20)) == [1, 2, 3, 4, 5]
    assert manager.usage == 1
    assert manager.allocate_slots(make_request("b", [1]), 1) is None


def test_allocate_failure_leaves_state_unchanged():
    manager = make_manager(num_blocks=7)
    donor = make_request("donor", tokens(0, 8))
    compute(manager, donor)
    manager.free(donor)
    holder = make_request("holder", tokens(100, 12))
    manager.allocate_slots(holder, 12)
    free_before = manager.num_free_blocks
    block_ids_before = manager.get_block_ids(holder)
    queue_before = [b.block_id for b in manager.block_pool.free_block_queue]

    # Needs 3 blocks beyond its prefix hit; 3 are free but the hit itself is one of them.
    request = make_request("r", tokens(0, 4) + tokens(200, 12))
    blocks, num_hit = manager.get_computed_blocks(request)
    assert num_hit == 4 and blocks[0].ref_cnt == 0
    assert manager.allocate_slots(request, 12, blocks) is None
    assert blocks[0].ref_cnt == 0
    assert manager.num_free_blocks == free_before
    assert [b.block_id for b in manager.block_pool.free_block_queue] == queue_before
    assert manager.get_block_ids(request) == []
    assert manager.get_block_ids(holder) == block_ids_before
    # Only admissions that got their blocks are counted.
    assert manager.prefix_cache_queries == donor.num_tokens + holder.num_tokens

    # Growing a running request past the free blocks fails the same way.
    holder.num_computed_tokens = 12
    assert manager.allocate_slots(holder, 13) is None
    assert manager.get_block_ids(holder) == block_ids_before
    assert manager.num_free_blocks == free_before


def test_prefix_hit_covers_full_blocks_only():
    manager = make_manager()
    first = make_request("first", tokens(0, 10))  # blocks [0-3] [4-7] and a partial [8, 9]
    compute(manager, first)
    manager.free(first)

    second = make_request("second", tokens(0, 12) + [99])
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8
    assert [b.block_id for b in blocks] == manager_block_ids_of(manager, first)[:2]

    miss = make_request("miss", [99] + tokens(1, 11))
    assert manager.get_computed_blocks(miss) == ([], 0)


def manager_block_ids_of(manager: KVCacheManager, request: Request) -> list[int]:
    return [manager.block_pool.get_cached_block(h).block_id for h in request.block_hashes]


def test_last_prompt_token_is_always_recomputed():
    manager = make_manager()
    first = make_request("first", tokens(0, 8))
    compute(manager, first)
    manager.free(first)
    same = make_request("same", tokens(0, 8))
    blocks, num_hit = manager.get_computed_blocks(same)
    assert num_hit == 4 and len(blocks) == 1
    assert manager.allocate_slots(same, same.num_tokens - num_hit, blocks) is not None


def test_same_block_tokens_after_a_different_prefix_do_not_hit():
    manager = make_manager()
    first = make_request("first", tokens(0, 4) + tokens(50, 4) + [1])
    compute(manager, first)
    other = make_request("other", tokens(20, 4) + tokens(50, 4) + [1])
    assert manager.get_computed_blocks(other) == ([], 0)


def test_cache_salts_never_share():
    manager = make_manager()
    prompt = tokens(0, 9)
    compute(manager, make_request("a", prompt, cache_salt="tenant-a"))
    assert manager.get_computed_blocks(make_request("b", prompt, cache_salt="tenant-b"))[1] == 0
    assert manager.get_computed_blocks(make_request("none", prompt))[1] == 0
    assert manager.get_computed_blocks(make_request("a2", prompt, cache_salt="tenant-a"))[1] == 8


def test_hash_collision_never_returns_another_prompts_blocks(monkeypatch):
    def colliding(parent, token_ids, extra_keys=()):
        real = real_hash(parent, token_ids, extra_keys)
        return BlockHash(b"same", real.parent, real.token_ids, real.extra_keys)

    real_hash = kv_cache.hash_block_tokens
    monkeypatch.setattr(kv_cache, "hash_block_tokens", colliding)
    manager = make_manager()
    compute(manager, make_request("a", tokens(0, 9)))
    assert manager.get_computed_blocks(make_request("b", tokens(40, 9))) == ([], 0)
    # The genuine prefix still hits: the stored tokens match.
    assert manager.get_computed_blocks(make_request("c", tokens(0, 9)))[1] == 4


def test_hit_on_free_cached_blocks_takes_them_out_of_the_free_queue():
    manager = make_manager(num_blocks=11)
    first = make_request("first", tokens(0, 13))
    compute(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 10

    second = make_request("second", tokens(0, 13))
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 12
    new_ids = manager.allocate_slots(second, 1, blocks)
    assert len(new_ids) == 1 and new_ids[0] not in {b.block_id for b in blocks}
    queue = set(manager.block_pool.free_block_queue)
    for block in blocks:
        assert block.ref_cnt == 1 and block not in queue
    assert manager.num_free_blocks == 6
    assert manager.prefix_cache_queries == 26 and manager.prefix_cache_hits == 12


def test_shared_blocks_stay_in_use_until_every_holder_frees():
    manager = make_manager()
    first = make_request("first", tokens(0, 9))
    compute(manager, first)
    second = make_request("second", tokens(0, 8) + [77])
    compute(manager, second)
    shared = manager.req_to_blocks["first"][:2]
    assert manager.req_to_blocks["second"][:2] == shared
    assert all(b.ref_cnt == 2 for b in shared)
    manager.free(first)
    assert all(b.ref_cnt == 1 for b in shared)
    assert manager.usage == pytest.approx(3 / 10)
    manager.free(second)
    assert manager.usage == 0


def test_eviction_is_lru_and_tail_first():
    manager = make_manager(num_blocks=9)  # 8 usable
    first = make_request("first", tokens(0, 12) + [1])
    second = make_request("second", tokens(100, 12) + [1])
    compute(manager, first, 12)
    compute(manager, second, 12)
    manager.free(first)
    manager.free(second)
    assert cached_flags(manager, first) == [True, True, True]
    assert cached_flags(manager, second) == [True, True, True]

    # 2 never-used blocks go first, then the least recently freed request, tail block first.
    taker = make_request("taker", tokens(500, 40))
    taker_blocks = 3
    manager.allocate_slots(taker, taker_blocks * BLOCK_SIZE)
    assert cached_flags(manager, first) == [True, True, False]
    assert cached_flags(manager, second) == [True, True, True]
    taker.num_computed_tokens = taker_blocks * BLOCK_SIZE
    manager.allocate_slots(taker, 2 * BLOCK_SIZE)
    assert cached_flags(manager, first) == [False, False, False]
    assert cached_flags(manager, second) == [True, True, True]
    taker.num_computed_tokens += 2 * BLOCK_SIZE
    manager.allocate_slots(taker, BLOCK_SIZE)
    assert cached_flags(manager, second) == [True, True, False]


def test_blocks_scheduled_but_never_computed_are_not_cached():
    manager = make_manager()
    preempted = make_request("preempted", tokens(0, 9))
    blocks, num_hit = manager.get_computed_blocks(preempted)
    manager.allocate_slots(preempted, 9, blocks)
    # Preempted before the step ran: num_computed_tokens never advanced.
    manager.free(preempted)
    assert manager.get_computed_blocks(make_request("next", tokens(0, 9)))[1] == 0


def test_caching_disabled_never_hits():
    manager = make_manager(enable_caching=False)
    compute(manager, make_request("a", tokens(0, 9)))
    assert manager.get_computed_blocks(make_request("b", tokens(0, 9))) == ([], 0)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.prefix_cache_queries == 0


def test_check_invariants_catches_corruption():
    manager = make_manager()
    request = make_request("a", tokens(0, 9))
    manager.allocate_slots(request, 9)
    manager.req_to_blocks["a"][0].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt"):
        manager.check_invariants()


def test_reset_prefix_cache():
    manager = make_manager()
    request = make_request("a", tokens(0, 9))
    compute(manager, request)
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.reset_prefix_cache()
    manager.check_invariants()
    assert manager.get_computed_blocks(make_request("b", tokens(0, 9)))[1] == 0


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(1, BLOCK_SIZE)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(10, 0)


@pytest.mark.parametrize("enable_caching", [False, True])
def test_a_fork_shares_blocks_and_copies_the_partial_one_on_its_first_write(enable_caching):
    manager = make_manager(num_blocks=11, enable_caching=enable_caching)
    parent = make_request("parent", tokens(0, 10))  # [0-3] [4-7] and a partial [8, 9]
    compute(manager, parent)
    parent_ids = manager.get_block_ids(parent)
    child = make_request("child", tokens(0, 10) + [77])
    manager.fork(parent, child, 10)
    manager.check_invariants()
    assert child.num_computed_tokens == 10
    assert manager.get_block_ids(child) == parent_ids
    assert [manager.block_pool.blocks[i].ref_cnt for i in parent_ids] == [2, 2, 2]
    assert manager.num_shared_blocks() == 3 and manager.usage == pytest.approx(3 / 10)
    assert child.block_hashes == parent.block_hashes[:2]

    # The child writes token 10 into the shared partial block: it gets a copy of its own.
    assert manager.allocate_slots(child, 1) == []
    child_ids = manager.get_block_ids(child)
    assert child_ids[:2] == parent_ids[:2] and child_ids[2] not in parent_ids
    assert manager.take_block_copies() == [(parent_ids[2], child_ids[2])]
    assert manager.take_block_copies() == []
    assert manager.num_shared_blocks() == 2
    # The parent writes into its partial block, now its own again: no copy.
    parent.num_computed_tokens = 10
    assert manager.allocate_slots(parent, 1) == []
    assert manager.block_copies == []

    # A block goes back to the free queue only when its last holder frees it.
    manager.free(parent)
    assert [manager.block_pool.blocks[i].ref_cnt for i in parent_ids] == [1, 1, 0]
    assert manager.num_free_blocks == 10 - 3
    manager.free(child)
    assert manager.usage == 0


def test_a_fork_at_a_block_boundary_copies_nothing_and_needs_room_for_its_copy():
    manager = make_manager(num_blocks=5)
    parent = make_request("parent", tokens(0, 8))
    compute(manager, parent)
    child = make_request("child", tokens(0, 8) + [5])
    manager.fork(parent, child, 8)
    assert manager.allocate_slots(child, 1) is not None  # a fresh block, nothing shared
    assert manager.block_copies == []
    manager.free(child)

    # A fork that must copy but finds no free block changes nothing.
    other = make_request("other", tokens(0, 6) + [9])
    manager.fork(parent, other, 6)
    filler = make_request("filler", tokens(50, 8))
    assert manager.allocate_slots(filler, 8) is not None  # the last 2 free blocks
    assert manager.allocate_slots(other, 1) is None
    assert manager.block_copies == [] and manager.num_shared_blocks() == 2
    manager.check_invariants()


def test_freeing_a_request_drops_the_copies_of_its_step():
    manager = make_manager()
    parent = make_request("parent", tokens(0, 6))
    compute(manager, parent)
    child = make_request("child", tokens(0, 6) + [1])
    manager.fork(parent, child, 6)
    manager.allocate_slots(child, 1)
    assert len(manager.block_copies) == 1
    manager.free(child)  # preempted before its step ran
    assert manager.block_copies == []
    manager.check_invariants()


def test_fork_refuses_what_it_cannot_share():
    manager = make_manager()
    parent = make_request("parent", tokens(0, 6))
    with pytest.raises(ValueError, match="holds no blocks"):
        manager.fork(parent, make_request("c", tokens(0, 7)), 3)
    compute(manager, parent, 4)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 4\]"):
        manager.fork(parent, make_request("c", tokens(0, 7)), 5)
    manager.fork(parent, make_request("c", tokens(0, 7)), 4)
    with pytest.raises(ValueError, match="already has blocks"):
        manager.fork(parent, make_request("c", tokens(0, 7)), 4)


def test_check_invariants_counts_every_holder_of_a_shared_block():
    manager = make_manager()
    parent = make_request("parent", tokens(0, 8))
    compute(manager, parent)
    manager.fork(parent, make_request("child", tokens(0, 9)), 8)
    manager.check_invariants()
    manager.block_pool.blocks[manager.get_block_ids(parent)[0]].ref_cnt = 1
    with pytest.raises(AssertionError, match="held by 2 request"):
        manager.check_invariants()
