"""KV blocks off the GPU: swapped requests, the CPU tier of the prefix cache, and when
swapping beats recomputing, over the pinned CPU pool's ids (engine/core/cpu_block_pool.py).

Only ids and counts live here, as in kv_cache.py; the workers hold the pool's tensors and copy
(engine/worker/kv_swap.py). The pool's blocks serve two owners:

- requests preempted by swapping (`swap_out`): their computed blocks are copied out and back
  when they resume (`resume`), which then needs no recomputation;
- the prefix cache's CPU tier: a full GPU block evicted from the prefix cache is copied here
  (`on_gpu_evict`), keyed by its `BlockHash` (tenants' salts included), LRU. A prompt whose
  prefix continues in this tier gets GPU blocks with the KV copied in (`cpu_prefix_hits`).

Swapped requests win: taking blocks for a swap evicts tier blocks, never the reverse.

The copies of one step go out with its `SchedulerOutput` (`take_copies`) and every worker
applies them in one order: all reads of a step before its writes, so a block freed and reused
within the step is read first. A block written by the step being scheduled cannot be read by
that same step: tier entries and swapped requests whose copy-out is not yet launched are
skipped until it is.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.block_pool import KVCacheBlock, cdiv
from engine.core.cpu_block_pool import CpuBlockPool
from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request


@dataclass(frozen=True)
class SwapCostModel:
    """When swapping a preempted request's KV beats recomputing it (preemption_mode="auto").

    Recomputing N tokens costs the device N / prefill_tokens_per_s. Swapping costs the copy
    out and the copy back, N x kv_bytes_per_token / copy_bytes_per_s each, plus fixed_s: the
    per-layer copy launches and the resumed step's wait, which do not shrink with N. So swap
    wins from N = fixed_s / (1 / prefill_tokens_per_s - 2 x kv_bytes_per_token /
    copy_bytes_per_s), and never where copying a token is slower than computing it. The
    ranks measure the rates at start (engine/worker/kv_swap.py, swap_space_info): a
    forward's prompt tokens per second, and copies of one block and of many into the cache.

    Recomputing is counted in full, as the copy is: blocks a recomputed request still finds
    in the prefix cache make it cheaper, and copies overlap the steps, which makes swapping
    cheaper; neither is known when the victim is picked.
    """

    prefill_tokens_per_s: float
    copy_bytes_per_s: float
    kv_bytes_per_token: float
    fixed_s: float

    def threshold_tokens(self) -> int | None:
        """Computed tokens from which swapping is cheaper; None: never."""
        saved_per_token = (
            1.0 / self.prefill_tokens_per_s - 2.0 * self.kv_bytes_per_token / self.copy_bytes_per_s
        )
        if saved_per_token <= 0:
            return None
        return max(1, math.ceil(self.fixed_s / saved_per_token))


KV_COPY_BYTES_PER_STEP = 512 << 20
"""Bytes of KV one step copies between a rank's cache and its pool. Each copy is staged on
the GPU while it runs, outside the memory the KV cache was sized from, so a step's copies are
bounded: beyond this, evicted blocks do not enter the CPU tier, tier hits are cut short, and
a swap out or in waits (or the victim is recomputed) unless it is the step's first copy."""


@dataclass(frozen=True)
class OffloadSettings:
    """What the engine learns from its ranks for the scheduler's KVOffload."""

    num_cpu_blocks: int
    swap_threshold_tokens: int | None = None
    """preemption_mode="auto": swap from this many computed tokens (None: never)."""
    max_copy_blocks: int | None = None
    """Blocks a step may copy (KV_COPY_BYTES_PER_STEP); None: no bound."""


class KVOffload:
    """The scheduler's side of swap and the CPU tier, over its KVCacheManager."""

    def __init__(
        self,
        kv: KVCacheManager,
        settings: OffloadSettings,
        preemption_mode: str,
        policy: str = "fcfs",
    ):
        self.kv = kv
        self.block_size = kv.block_size
        self.pool = CpuBlockPool(settings.num_cpu_blocks)
        self.preemption_mode = preemption_mode
        self.policy = policy
        self.swap_threshold_tokens = settings.swap_threshold_tokens
        """preemption_mode="auto": swap from this many computed tokens (None: never)."""
        self.max_copy_blocks = settings.max_copy_blocks
        self.swapped: list[Request] = []
        """Swapped-out requests in the order they resume: arrival, or (priority, arrival)
        under the priority policy."""
        self._copies_in: list[tuple[int, int]] = []
        self._copies_out: dict[int, int] = {}
        """cpu block -> gpu block to copy out this step (a cpu block written twice: the last)."""
        self._unlaunched: set[int] = set()
        """CPU blocks this step writes: not readable before the next step."""
        self._taken: tuple[list, dict, set] = ([], {}, set())
        self._reserved = 0
        """Copies in counted before their GPU blocks are allocated (whose evictions copy too)."""
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_cpu_hit_tokens = 0
        """Prompt tokens served from the CPU tier (also counted in the prefix-cache hits)."""
        if kv.enable_caching:
            kv.block_pool.evict_listener = self.on_gpu_evict

    # -- swap -------------------------------------------------------------------------------

    def can_swap(self, request: Request) -> bool:
        """Whether preempting `request` now would swap it: the mode says so (auto: from the
        threshold on) and the pool has room, evicting tier blocks if need be."""
        num_computed = request.num_computed_tokens
        if self.preemption_mode == "recompute" or num_computed == 0:
            return False
        if self.preemption_mode == "auto" and (
            self.swap_threshold_tokens is None or num_computed < self.swap_threshold_tokens
        ):
            return False
        num_blocks = cdiv(num_computed, self.block_size)
        room = num_blocks <= self.pool.num_free + len(self.pool.tier)
        return room and self._copy_room(num_blocks)

    def _num_copies(self) -> int:
        return len(self._copies_in) + len(self._copies_out) + self._reserved

    def _copy_room(self, num_blocks: int) -> bool:
        """Whether this step may copy `num_blocks` more (its first copy always may)."""
        num_copies = self._num_copies()
        if self.max_copy_blocks is None or num_copies == 0:
            return True
        return num_copies + num_blocks <= self.max_copy_blocks

    def swap_out(self, request: Request) -> bool:
        """Copy the request's computed blocks out, before the scheduler frees them; False (and
        nothing done) when it is not to be swapped (can_swap)."""
        if not self.can_swap(request):
            return False
        num_blocks = cdiv(request.num_computed_tokens, self.block_size)
        gpu_blocks = self.kv.req_to_blocks[request.request_id][:num_blocks]
        cpu_ids = self.pool.take_for_swap(num_blocks)
        for gpu_block, cpu_id in zip(gpu_blocks, cpu_ids, strict=True):
            self._copy_out(gpu_block.block_id, cpu_id)
            # Held by this request alone: its copy is on the CPU now, and a cached GPU copy
            # would only be copied out again when evicted.
            if gpu_block.ref_cnt == 1:
                self.kv.block_pool.uncache_block(gpu_block)
        self.pool.swapped[request.request_id] = cpu_ids
        bisect.insort_right(self.swapped, request, key=self._queue_key)
        self.num_swap_outs += 1
        return True

    def _queue_key(self, request: Request) -> tuple:
        if self.policy == "priority":
            return (request.priority, request.arrival_time)
        return (request.arrival_time,)

    def next_to_resume(self, waiting_head: Request | None) -> Request | None:
        """The swapped request to bring back before `waiting_head`, if any: the swapped queue
        goes first unless the waiting head comes before it in the policy's order."""
        if not self.swapped:
            return None
        request = self.swapped[0]
        if waiting_head is not None and self._queue_key(waiting_head) < self._queue_key(request):
            return None
        # Its copy out goes with the step being scheduled, or its last token is still in
        # flight (the workers get it as a new request, with every token known here).
        if request.num_output_placeholders or request.num_tokens <= request.num_computed_tokens:
            return None
        if any(b in self._unlaunched for b in self.pool.swapped[request.request_id]):
            return None
        return request

    def resume(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Give a swapped request GPU blocks again (hits where its blocks stayed cached, the
        rest copied in) and room for `num_new_tokens`; its new block ids, or None when the
        GPU blocks do not suffice (nothing changed)."""
        num_computed = request.num_computed_tokens
        num_blocks = cdiv(num_computed, self.block_size)
        hits, _ = self.kv.get_computed_blocks(request)
        hits = hits[: num_computed // self.block_size]
        if not self._copy_room(num_blocks - len(hits)):
            return None  # the next step copies it
        request.num_computed_tokens = 0
        self._reserved = num_blocks - len(hits)
        try:
            new_ids = self.kv.allocate_slots(
                request, num_computed - len(hits) * self.block_size + num_new_tokens, hits
            )
        finally:
            request.num_computed_tokens = num_computed
            self._reserved = 0
        if new_ids is None:
            return None
        cpu_ids = self.pool.swapped.pop(request.request_id)
        targets = new_ids[: num_blocks - len(hits)]
        self._copies_in += zip(cpu_ids[len(hits) :], targets, strict=True)
        self.pool.release(cpu_ids)
        self.swapped.remove(request)
        self.num_swap_ins += 1
        return new_ids

    def drop(self, request: Request) -> bool:
        """Forget a swapped request (finished or aborted while out); False if it was not."""
        cpu_ids = self.pool.swapped.pop(request.request_id, None)
        if cpu_ids is None:
            return False
        self.pool.release(cpu_ids)
        self.swapped.remove(request)
        return True

    # -- the prefix cache's CPU tier --------------------------------------------------------

    def on_gpu_evict(self, block: KVCacheBlock) -> None:
        """A cached GPU block is about to be reused: keep its KV in the tier (if the step's
        copies have room: else it is simply gone, as without a tier)."""
        if not self._copy_room(1):
            return
        cpu_id = self.pool.tier_add(block.block_hash)
        if cpu_id is not None:
            self._copy_out(block.block_id, cpu_id)

    def cpu_prefix_hits(self, request: Request, num_gpu_hit_blocks: int) -> list[int]:
        """Tier blocks that continue a request's GPU prefix hits (never its last token)."""
        self._reserved = 0
        if not self.kv.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        found = []
        for block_hash in request.block_hashes[num_gpu_hit_blocks:max_blocks]:
            cpu_id = self.pool.tier_lookup(block_hash)
            if cpu_id is None or cpu_id in self._unlaunched:
                break
            found.append(cpu_id)
        if self.max_copy_blocks is not None:
            found = found[: max(0, self.max_copy_blocks - self._num_copies())]
        self._reserved = len(found)  # until copy_in_hits, after their blocks are allocated
        return found

    def copy_in_hits(self, cpu_ids: Sequence[int], gpu_block_ids: Sequence[int]) -> None:
        """Tier hits an admitted request got fresh GPU blocks for (the first of its new ones)."""
        self._reserved = 0
        self._copies_in += zip(cpu_ids, gpu_block_ids[: len(cpu_ids)], strict=True)
        self.num_cpu_hit_tokens += len(cpu_ids) * self.block_size

    def reset_prefix_cache(self) -> None:
        """Forget the tier and its hit count (the engine's warm-up leaves nothing behind)."""
        self.pool.clear_tier()
        self.num_cpu_hit_tokens = 0

    # -- one step's copies ------------------------------------------------------------------

    def _copy_out(self, gpu_block_id: int, cpu_id: int) -> None:
        self._copies_out[cpu_id] = gpu_block_id
        self._unlaunched.add(cpu_id)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (cpu, gpu) copies in and (gpu, cpu) copies out, for SchedulerOutput."""
        copies_in, copies_out = self._copies_in, self._copies_out
        self._reserved = 0
        self._taken = (copies_in, copies_out, self._unlaunched)
        self._copies_in, self._copies_out, self._unlaunched = [], {}, set()
        return copies_in, [(gpu, cpu) for cpu, gpu in copies_out.items()]

    def defer_copies(self) -> None:
        """The last step taken was not launched: its copies go with the next one (first)."""
        copies_in, copies_out, unlaunched = self._taken
        self._copies_in = copies_in + self._copies_in
        self._copies_out = copies_out | self._copies_out
        self._unlaunched |= unlaunched
        self._taken = ([], {}, set())

    def stats(self) -> dict[str, float]:
        return {
            "num_swapped": len(self.swapped),
            "num_swap_outs": self.num_swap_outs,
            "num_swap_ins": self.num_swap_ins,
            "cpu_kv_cache_usage": self.pool.usage,
            "cpu_prefix_cache_usage": self.pool.tier_usage,
            "cpu_prefix_cache_hits": self.num_cpu_hit_tokens,
        }

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        ids = sorted(r.request_id for r in self.swapped)
        if ids != sorted(self.pool.swapped):
            raise AssertionError("swapped queue and swapped blocks disagree")


def offload_settings(
    rank_infos: list[dict[str, float]], preemption_mode: str
) -> OffloadSettings | None:
    """The pool blocks every rank holds, the auto mode's swap threshold and the step's copy
    bound, from the ranks' kv_swap_info; None without a pool. The threshold uses the slowest rank's copies and
    prefill rate. Pipeline stages cannot time a forward alone: without any prefill rate auto
    swaps from the first block (on a GPU, copying a token's KV over PCIe takes a fraction of
    the time computing it does for any model worth splitting into stages)."""
    if not rank_infos:
        return None
    num_blocks = int(min(info["num_cpu_blocks"] for info in rank_infos))
    block_bytes = max(info["block_bytes"] for info in rank_infos)
    max_copy_blocks = max(1, KV_COPY_BYTES_PER_STEP // int(block_bytes))
    if preemption_mode != "auto":
        return OffloadSettings(num_blocks, None, max_copy_blocks)
    prefill = [i["prefill_tokens_per_s"] for i in rank_infos if "prefill_tokens_per_s" in i]
    if not prefill:
        return OffloadSettings(num_blocks, 1, max_copy_blocks)
    model = SwapCostModel(
        prefill_tokens_per_s=min(prefill),
        copy_bytes_per_s=min(i["copy_bytes_per_s"] for i in rank_infos),
        kv_bytes_per_token=max(i["kv_bytes_per_token"] for i in rank_infos),
        fixed_s=max(i["fixed_s"] for i in rank_infos),
    )
    return OffloadSettings(num_blocks, model.threshold_tokens(), max_copy_blocks)
