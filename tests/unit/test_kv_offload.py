"""Swap and the prefix cache's CPU tier without a model: the CPU pool's bookkeeping, the cost
model of preemption_mode="auto", and the scheduler driven by the fake runner of
test_scheduler.py with a fake CPU pool, which checks every computed position's KV each step
(a block copied wrong, or read before its copy, fails there)."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core.block_hash import hash_block_tokens
from engine.core.cpu_block_pool import CpuBlockPool
from engine.core.kv_offload import (
    KV_COPY_BYTES_PER_STEP,
    OffloadSettings,
    SwapCostModel,
    offload_settings,
)
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tests.unit.test_scheduler import (
    BLOCK_SIZE,
    FakeRunner,
    make_request,
    reference_outputs,
    step,
)


class SwapFakeRunner(FakeRunner):
    """FakeRunner with a CPU pool: a step's copies read before they write, as the workers'."""

    def __init__(self):
        super().__init__()
        self.cpu: dict[int, dict] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        staged = [(gpu, dict(self.cpu.get(cpu, {}))) for cpu, gpu in out.kv_copies_in]
        for gpu, cpu in out.kv_copies_out:
            self.cpu[cpu] = dict(self.kv.get(gpu, {}))
        for gpu, content in staged:
            self.kv[gpu] = content
        return super().execute(out)


def swap_scheduler(
    num_blocks: int,
    num_cpu_blocks: int,
    mode: str = "swap",
    policy: str = "fcfs",
    caching: bool = False,
    threshold: int | None = None,
    max_copy_blocks: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=64,
            max_model_len=256,
            policy=policy,
            preemption_mode=mode,
        ),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching),
        num_blocks,
        OffloadSettings(num_cpu_blocks, threshold, max_copy_blocks),
    )


def run(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 500) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs.append(step(scheduler, runner)[0])
        scheduler.offload.check_invariants()
        assert len(outputs) < max_steps, "a hang"
    return outputs


def crowd(n: int = 4, prompt: int = 9, max_tokens: int = 12):
    return [make_request(f"r{i}", prompt, arrival_time=float(i), max_tokens=max_tokens)
            for i in range(n)]  # fmt: skip


def assert_all_free(scheduler: Scheduler) -> None:
    kv, offload = scheduler.kv_cache_manager, scheduler.offload
    kv.check_invariants()
    offload.check_invariants()
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks
    assert not offload.swapped and not offload.pool.swapped
    assert offload.pool.num_free + len(offload.pool.tier) == offload.pool.num_blocks


@pytest.mark.parametrize("caching", [False, True])
def test_swapped_requests_resume_with_their_kv_and_compute_each_token_once(caching):
    # 4 requests of 9 + 12 tokens need 6 blocks each; 13 blocks hold two of them.
    scheduler = swap_scheduler(num_blocks=14, num_cpu_blocks=64, caching=caching)
    requests = crowd()
    for request in requests:
        scheduler.add_request(request)
    outputs = run(scheduler, SwapFakeRunner())
    assert scheduler.offload.num_swap_outs > 0
    assert scheduler.offload.num_swap_ins == scheduler.offload.num_swap_outs
    for request in requests:
        assert request.output_token_ids == reference_outputs(request, 12)
    # Nothing recomputed: each prompt token and each output but the last computed once.
    assert sum(o.total_num_scheduled_tokens for o in outputs) == 4 * (9 + 12 - 1)
    resumed = [n for o in outputs for n in o.scheduled_new_reqs if n.num_computed_tokens > 0]
    assert resumed and all(n.num_computed_tokens > 9 for n in resumed)
    assert_all_free(scheduler)


def test_a_full_cpu_pool_falls_back_to_recompute():
    scheduler = swap_scheduler(num_blocks=14, num_cpu_blocks=2)  # a victim needs 3+ blocks
    requests = crowd()
    for request in requests:
        scheduler.add_request(request)
    outputs = run(scheduler, SwapFakeRunner())
    assert scheduler.num_preemptions > 0 and scheduler.offload.num_swap_outs == 0
    assert sum(o.total_num_scheduled_tokens for o in outputs) > 4 * (9 + 12 - 1)
    for request in requests:
        assert request.output_token_ids == reference_outputs(request, 12)
    assert_all_free(scheduler)


def test_auto_swaps_only_from_its_threshold_on():
    never = swap_scheduler(num_blocks=14, num_cpu_blocks=64, mode="auto", threshold=None)
    always = swap_scheduler(num_blocks=14, num_cpu_blocks=64, mode="auto", threshold=1)
    for scheduler in (never, always):
        for request in crowd():
            scheduler.add_request(request)
        run(scheduler, SwapFakeRunner())
    assert never.num_preemptions > 0 and never.offload.num_swap_outs == 0
    assert always.offload.num_swap_outs > 0


def test_aborting_a_swapped_request_frees_its_cpu_blocks():
    scheduler = swap_scheduler(num_blocks=14, num_cpu_blocks=64)
    requests = crowd()
    for request in requests:
        scheduler.add_request(request)
    runner = SwapFakeRunner()
    while not scheduler.offload.swapped:
        step(scheduler, runner)
    victim = scheduler.offload.swapped[0]
    assert scheduler.stats()["num_swapped"] == 1
    assert scheduler.get_num_unfinished_requests() == 4
    scheduler.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
    assert victim.request_id not in scheduler.offload.pool.swapped
    run(scheduler, runner)
    for request in requests:
        if request is not victim:
            assert request.output_token_ids == reference_outputs(request, 12)
    assert_all_free(scheduler)


def test_a_more_urgent_arrival_swaps_out_a_running_request():
    scheduler = swap_scheduler(num_blocks=7, num_cpu_blocks=64, policy="priority")
    runner = SwapFakeRunner()
    low = make_request("low", 9, priority=5, arrival_time=0.0, max_tokens=12)
    scheduler.add_request(low)
    for _ in range(3):
        step(scheduler, runner)
    urgent = make_request("urgent", 16, priority=0, arrival_time=1.0, max_tokens=4)
    scheduler.add_request(urgent)
    out, _ = step(scheduler, runner)
    assert "urgent" in out.num_scheduled_tokens and "low" not in out.num_scheduled_tokens
    assert scheduler.offload.swapped == [low] and out.kv_copies_out
    run(scheduler, runner)
    assert low.output_token_ids == reference_outputs(low, 12)
    assert urgent.output_token_ids == reference_outputs(urgent, 4)
    assert scheduler.offload.num_swap_ins == 1
    assert_all_free(scheduler)


def test_evicted_prefix_blocks_are_hit_in_the_cpu_tier_and_copied_in():
    scheduler = swap_scheduler(num_blocks=9, num_cpu_blocks=32, caching=True)
    runner = SwapFakeRunner()
    first = make_request("first", 17, max_tokens=2)
    scheduler.add_request(first)
    run(scheduler, runner)
    # Other prompts take every GPU block: first's cached blocks are evicted to the tier.
    for i in range(3):
        scheduler.add_request(make_request(f"other{i}", 17, max_tokens=2))
        run(scheduler, runner)
    again = make_request("again", first.prompt_token_ids, max_tokens=2)
    scheduler.add_request(again)
    outputs = run(scheduler, runner)
    assert again.num_cached_tokens == 16  # 4 full blocks; the last token is recomputed
    assert scheduler.offload.num_cpu_hit_tokens == 16
    assert outputs[0].num_scheduled_tokens["again"] == 1
    assert len(outputs[0].kv_copies_in) == 4
    assert again.output_token_ids == reference_outputs(again, 2)
    # Another tenant's salt names other blocks: no hit.
    salted = make_request("salted", first.prompt_token_ids, max_tokens=2, cache_salt="t2")
    scheduler.add_request(salted)
    run(scheduler, runner)
    assert salted.num_cached_tokens == 0
    assert scheduler.stats()["cpu_prefix_cache_hits"] == 16
    assert_all_free(scheduler)


def test_swapped_requests_win_the_pool_over_the_tier():
    pool = CpuBlockPool(4)
    hashes = [hash_block_tokens(None, [i] * BLOCK_SIZE) for i in range(5)]
    assert [pool.tier_add(h) for h in hashes[:4]] == [0, 1, 2, 3]
    assert pool.tier_add(hashes[4]) == 0  # LRU: the first one's block
    assert pool.tier_lookup(hashes[0]) is None and pool.tier_lookup(hashes[1]) == 1
    pool.swapped["r"] = pool.take_for_swap(3)  # evicts 2 and 3 first (1 was just used)
    assert sorted(pool.swapped["r"]) == [0, 2, 3] and pool.tier_lookup(hashes[1]) == 1
    pool.check_invariants()
    assert pool.take_for_swap(2) is None  # only the tier's one block could make room
    pool.swapped["s"] = pool.take_for_swap(1)
    assert pool.tier_add(hashes[2]) is None  # all held by swapped requests
    pool.release(pool.swapped.pop("r"))
    assert pool.tier_add(hashes[2]) == 0  # lowest free first
    pool.check_invariants()


def test_a_tier_lookup_compares_the_whole_key():
    pool = CpuBlockPool(2)
    mine = hash_block_tokens(None, [1, 2, 3, 4], ("tenant-a",))
    pool.tier_add(mine)
    theirs = hash_block_tokens(None, [1, 2, 3, 4], ("tenant-b",))
    assert pool.tier_lookup(theirs) is None
    forged = mine._replace(token_ids=(9, 9, 9, 9))  # same digest, other tokens
    assert pool.tier_lookup(forged) is None and pool.tier_lookup(mine) == 0


def test_the_swap_threshold_follows_the_cost_model():
    # Recompute 1e-4 s a token; copy out and back 2 x 1e3 B / 1e8 B/s = 2e-5 s.
    model = SwapCostModel(
        prefill_tokens_per_s=1e4, copy_bytes_per_s=1e8, kv_bytes_per_token=1e3, fixed_s=8e-4
    )
    assert model.threshold_tokens() == 10  # 8e-4 / (1e-4 - 2e-5)
    slow_copy = SwapCostModel(1e4, 1e7, 1e3, 8e-4)  # 2e-4 s a token to copy: never
    assert slow_copy.threshold_tokens() is None


def test_offload_settings_take_the_smallest_pool_and_the_slowest_rates():
    ranks = [
        {"num_cpu_blocks": 10, "block_bytes": 2**20, "copy_bytes_per_s": 1e8, "fixed_s": 4e-4,
         "kv_bytes_per_token": 1e3, "prefill_tokens_per_s": 2e4},
        {"num_cpu_blocks": 8, "block_bytes": 2**21, "copy_bytes_per_s": 2e8, "fixed_s": 8e-4,
         "kv_bytes_per_token": 1e3, "prefill_tokens_per_s": 1e4},
    ]  # fmt: skip
    copy_blocks = KV_COPY_BYTES_PER_STEP // 2**21  # the larger block bounds a step's copies
    assert offload_settings(ranks, "auto") == OffloadSettings(8, 10, copy_blocks)
    assert offload_settings(ranks, "swap") == OffloadSettings(8, None, copy_blocks)
    assert offload_settings([], "auto") is None
    stages = [{k: v for k, v in r.items() if k != "prefill_tokens_per_s"} for r in ranks]
    assert offload_settings(stages, "auto") == OffloadSettings(8, 1, copy_blocks)


@pytest.mark.parametrize("max_copy_blocks", [None, 3])
@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_with_shared_prefixes_keeps_every_kv_right(seed, max_copy_blocks):
    """Swaps, evictions to the tier and tier hits in the same steps, with arrivals as the
    requests run: the fake runner checks each computed position's KV every step. With a
    bound on a step's copies, only a step's first copy may pass it."""
    import random

    rng = random.Random(seed)
    scheduler = swap_scheduler(
        num_blocks=rng.randint(10, 16), num_cpu_blocks=rng.randint(6, 24), caching=True,
        policy=rng.choice(["fcfs", "priority"]), max_copy_blocks=max_copy_blocks,
    )  # fmt: skip
    runner = SwapFakeRunner()
    prefixes = [[rng.randrange(10, 60) for _ in range(8)] for _ in range(3)]
    pending = []
    for i in range(14):
        prompt = rng.choice(prefixes) + [rng.randrange(10, 60) for _ in range(rng.randint(1, 9))]
        pending.append(make_request(f"r{i}", prompt, priority=rng.randint(0, 2),
                                    arrival_time=float(i), max_tokens=rng.randint(2, 10)))  # fmt: skip
    requests = list(pending)
    for _ in range(400):
        if pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if not scheduler.has_unfinished_requests():
            if not pending:
                break
            continue
        out, _ = step(scheduler, runner)
        num_copies = len(out.kv_copies_in) + len(out.kv_copies_out)
        if max_copy_blocks is not None and num_copies > max_copy_blocks:
            assert out.kv_copies_in == [] or out.kv_copies_out == [], "past the bound twice"
        scheduler.offload.check_invariants()
    assert not pending and not scheduler.has_unfinished_requests()
    for request in requests:
        assert request.output_token_ids == reference_outputs(
            request, request.sampling_params.max_tokens
        )
    assert_all_free(scheduler)


def test_a_block_evicted_to_the_tier_is_not_read_by_the_step_that_copies_it_out():
    # P's blocks are freed tail first; then Q's. 2 fresh blocks + 4 usable by P + 2 by Q.
    scheduler = swap_scheduler(num_blocks=1 + 2 + 5 + 2, num_cpu_blocks=16, caching=True)
    runner = SwapFakeRunner()
    p = make_request("p", 17, max_tokens=2)
    q = make_request("q", 5, max_tokens=2)
    for request in (p, q):
        scheduler.add_request(request)
        run(scheduler, runner)
    # A takes the 2 fresh blocks and the LRU ones of P: its partial block and its 4th full
    # block, which goes to the tier in this very step. B (P's prompt) then hits P's first 3
    # blocks on the GPU; the 4th is on its way to the CPU, so B computes it again.
    a = make_request("a", 16, max_tokens=2)
    b = make_request("b", p.prompt_token_ids, max_tokens=2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out, _ = step(scheduler, runner)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    # P's 4th block and Q's full block (B's new blocks) go to the tier; nothing comes back.
    assert len(out.kv_copies_out) == 2 and not out.kv_copies_in
    assert b.num_cached_tokens == 12
    run(scheduler, runner)
    assert b.output_token_ids == reference_outputs(b, 2)
    assert_all_free(scheduler)


def test_swap_keys_are_checked_naming_the_field_and_the_host():
    from engine.config import EngineArgs, check_swap_space, host_memory_bytes

    with pytest.raises(ValueError, match="swap_space"):
        EngineArgs(swap_space=-0.5)
    with pytest.raises(ValueError, match="(?s)preemption_mode.*'recompute', 'swap' or 'auto'"):
        EngineArgs(preemption_mode="drop")
    with pytest.raises(ValueError, match=r"swap_space=30 GiB x 2 rank\(s\).*host's 64.0 GiB"):
        check_swap_space(30, 2, total=64 * 2**30)
    check_swap_space(20, 2, total=64 * 2**30)  # 40 GiB: within 70%
    too_much = host_memory_bytes() / 2**30  # the whole host, for one rank
    with pytest.raises(ValueError, match="swap_space=.*lower swap_space"):
        EngineArgs(device="cpu", swap_space=too_much).create_engine_config()
    config = EngineArgs(device="cpu", swap_space=0.5, preemption_mode="swap")
    engine_config = config.create_engine_config()
    assert engine_config.cache_config.swap_space == 0.5
    assert engine_config.scheduler_config.preemption_mode == "swap"


def test_copies_of_a_step_not_launched_go_with_the_next_and_stay_unreadable_until_then():
    from engine.core.kv_cache import KVCacheManager
    from engine.core.kv_offload import KVOffload

    kv = KVCacheManager(num_blocks=9, block_size=BLOCK_SIZE, enable_caching=False)
    offload = KVOffload(kv, OffloadSettings(num_cpu_blocks=8), preemption_mode="swap")
    request = make_request("r", 9, max_tokens=4)
    kv.allocate_slots(request, 9)
    request.num_computed_tokens = 9
    request.append_output_token_ids(50)  # its sampled token is known: it can resume
    gpu_ids = kv.get_block_ids(request)
    assert offload.swap_out(request)
    kv.free(request)
    assert offload.next_to_resume(None) is None  # its copy out is not launched yet
    copies_in, copies_out = offload.take_copies()
    assert copies_in == [] and sorted(copies_out) == [(g, c) for g, c in zip(gpu_ids, range(3))]
    offload.defer_copies()  # that step was never launched
    assert offload.next_to_resume(None) is None
    assert offload.take_copies() == ([], copies_out)
    assert offload.next_to_resume(None) is request
    assert offload.resume(request, 1) is not None
    copies_in, _ = offload.take_copies()
    assert [c for c, _ in copies_in] == [0, 1, 2]
    assert [g for _, g in copies_in] == kv.get_block_ids(request)[:3]
    offload.check_invariants()
