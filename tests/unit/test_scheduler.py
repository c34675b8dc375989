"""Scheduler driven by a fake model runner: budgets, admission order, preemption, stopping.

The fake runner keeps worker-side state only from the SchedulerOutputs it receives, records
which token context every KV slot was written with, and checks before each step that every
computed position of every scheduled request holds the right KV. So a wrong block table, a
stale prefix-cache hit or a lost diff fails loudly, not just a wrong count.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2


def make_scheduler(
    num_blocks: int = 65,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    max_prefill_tokens_with_decodes: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=policy,
            max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
        ),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
    )


def make_request(
    request_id: str,
    prompt: int | list[int],
    priority: int = 0,
    arrival_time: float = 0.0,
    eos_token_id: int | None = EOS,
    cache_salt: str | None = None,
    **params,
) -> Request:
    if isinstance(prompt, int):
        seed = sum(map(ord, request_id))
        prompt = [10 + (seed * 7 + i) % 50 for i in range(prompt)]
    params.setdefault("max_tokens", 4)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**params),
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
    )


def next_token(token_ids: list[int]) -> int:
    """A deterministic stand-in for a model: depends on the whole context, never EOS."""
    return 10 + (sum(token_ids[-3:]) * 31 + len(token_ids)) % 50


@dataclass
class _WorkerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeRunner:
    def __init__(self, sample: Callable[[str, list[int]], int] | None = None):
        self.sample = sample or (lambda req_id, token_ids: next_token(token_ids))
        self.states: dict[str, _WorkerState] = {}
        self.kv: dict[int, dict[int, tuple[int, ...]]] = {}
        """block id -> offset -> the token context the slot was computed with."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent in full twice"
            self.states[new.req_id] = _WorkerState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for cached in out.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            assert cached.num_computed_tokens == state.num_computed_tokens
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
        assert set(out.num_scheduled_tokens) == {
            r.req_id for r in out.scheduled_new_reqs + out.scheduled_cached_reqs
        }
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        # Copy-on-write of forked blocks, before the forward (engine/worker/block_copy.py).
        for src, dst in out.blocks_to_copy:
            self.kv[dst] = dict(self.kv.get(src, {}))

        # Like every attention layer: write the whole batch's KV first, then attend.
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            end = state.num_computed_tokens + n
            assert n > 0 and end <= len(state.token_ids)
            assert 0 not in state.block_ids, "the null block was handed to a request"
            assert len(state.block_ids) * BLOCK_SIZE >= end, "not enough slots"
            for pos in range(state.num_computed_tokens, end):
                block = self.kv.setdefault(state.block_ids[pos // BLOCK_SIZE], {})
                block[pos % BLOCK_SIZE] = tuple(state.token_ids[: pos + 1])
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            end = state.num_computed_tokens + n
            for pos in range(end):
                slot = self.kv.get(state.block_ids[pos // BLOCK_SIZE], {}).get(pos % BLOCK_SIZE)
                assert slot == tuple(state.token_ids[: pos + 1]), f"{req_id}: bad KV at {pos}"
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                sampled[req_id] = self.sample(req_id, state.token_ids)
        return ModelRunnerOutput(sampled_token_ids=sampled)


def check_scheduler(scheduler: Scheduler) -> None:
    scheduler.kv_cache_manager.check_invariants()
    kv = scheduler.kv_cache_manager
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
        assert 0 < request.num_computed_tokens <= request.num_tokens
        assert len(kv.get_block_ids(request)) * BLOCK_SIZE >= request.num_computed_tokens
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0
        assert kv.get_block_ids(request) == []
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    swapped = scheduler.offload.swapped if scheduler.offload is not None else []
    for request in swapped:  # swap_space: preempted with their computed tokens on the CPU
        assert request.status == RequestStatus.PREEMPTED and request.num_computed_tokens > 0
        assert kv.get_block_ids(request) == []
    awaiting_fork = sum(len(s) for s in scheduler._awaiting_fork.values())
    assert scheduler.get_num_unfinished_requests() == (
        len(scheduler.running) + len(scheduler.waiting) + len(swapped) + awaiting_fork
    )


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    # Before the step: which running requests are past their prompt, and which want more
    # than one token (a prompt, or a resumed request catching up).
    past_prompt = {
        r.request_id for r in scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens
    }
    decoding = {
        r
        for r in past_prompt
        if scheduler.requests[r].num_tokens - scheduler.requests[r].num_computed_tokens <= 1
    }
    behind = sum(r.num_tokens for r in scheduler.waiting) >= scheduler.config.max_num_batched_tokens
    out = scheduler.schedule()
    budget = scheduler.config.max_num_batched_tokens
    assert out.total_num_scheduled_tokens <= budget
    cap = scheduler.config.max_prefill_tokens_with_decodes
    capped = bool(cap and past_prompt and not behind)
    num_prompt_tokens = sum(n for r, n in out.num_scheduled_tokens.items() if r not in decoding)
    if capped:
        assert num_prompt_tokens <= cap
    # A running request is only left out of a step when the token budget is spent, or,
    # for a prompt beside decodes, the prompt tokens' share of it.
    left_out = [r for r in scheduler.running if r.request_id not in out.num_scheduled_tokens]
    if left_out:
        assert out.total_num_scheduled_tokens == budget or (
            capped
            and num_prompt_tokens == cap
            and all(r.request_id not in decoding for r in left_out)
        )
    updated = scheduler.update_from_output(out, runner.execute(out))
    check_scheduler(scheduler)
    return out, updated


def run_to_completion(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000
) -> list[SchedulerOutput]:
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        outputs.append(step(scheduler, runner)[0])
    raise AssertionError("scheduler did not finish: a hang")


def reference_outputs(request: Request, num_tokens: int) -> list[int]:
    token_ids = list(request.prompt_token_ids)
    for _ in range(num_tokens):
        token_ids.append(next_token(token_ids))
    return token_ids[request.num_prompt_tokens :]


def test_chunked_prefill_runs_alongside_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner()
    short = make_request("short", 6, max_tokens=10)
    scheduler.add_request(short)
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"short": 6}

    long = make_request("long", 40, max_tokens=2)
    scheduler.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out, updated = step(scheduler, runner)
        # The decode is scheduled first and the prompt takes the rest of the budget.
        assert list(out.num_scheduled_tokens) == ["short", "long"]
        assert out.num_scheduled_tokens["short"] == 1
        chunks.append(out.num_scheduled_tokens["long"])
        assert short in updated
        assert (long in updated) == (sum(chunks) == 40)
    assert chunks == [15, 15, 10]
    run_to_completion(scheduler, runner)
    assert long.output_token_ids == reference_outputs(long, 2)
    assert short.output_token_ids == reference_outputs(short, 10)


def test_prompts_take_a_smaller_share_of_a_step_while_requests_decode():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_prefill_tokens_with_decodes=16)
    runner = FakeRunner()
    short = make_request("short", 6, max_tokens=20)
    scheduler.add_request(short)
    long = make_request("long", 40, max_tokens=2)
    scheduler.add_request(long)
    # Nothing decodes yet: both prompts fit in the whole budget.
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"short": 6, "long": 40}

    later = make_request("later", 40, max_tokens=2)
    other = make_request("other", 10, max_tokens=2)
    scheduler.add_request(later)
    scheduler.add_request(other)
    steps = []
    while other.num_output_tokens == 0:
        out, _ = step(scheduler, runner)
        steps.append({r: n for r, n in out.num_scheduled_tokens.items() if r in ("later", "other")})
        assert out.num_scheduled_tokens["short"] == 1
    # 16 prompt tokens a step beside the decodes, in arrival order ("later" decodes in the last).
    assert steps == [
        {"later": 16},
        {"later": 16},
        {"later": 8, "other": 8},
        {"later": 1, "other": 2},
    ]
    run_to_completion(scheduler, runner)
    for request in (short, long, later, other):
        assert request.output_token_ids == reference_outputs(
            request, request.sampling_params.max_tokens
        )


def test_prompts_get_the_whole_step_back_while_a_step_of_tokens_waits():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_prefill_tokens_with_decodes=16)
    runner = FakeRunner()
    short = make_request("short", 6, max_tokens=20)
    scheduler.add_request(short)
    step(scheduler, runner)
    queued = [make_request(f"q{i}", 20, max_tokens=2) for i in range(4)]
    for request in queued:
        scheduler.add_request(request)
    # 80 tokens wait, more than a step holds: the prompts take all but the decode's token.
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"short": 1, "q0": 20, "q1": 20, "q2": 20, "q3": 3}
    # Nothing waits now (q3 runs, 17 tokens short): back to 16 prompt tokens a step.
    out, _ = step(scheduler, runner)
    assert {r: n for r, n in out.num_scheduled_tokens.items() if r == "q3"} == {"q3": 16}
    run_to_completion(scheduler, runner)
    for request in [short, *queued]:
        assert request.output_token_ids == reference_outputs(
            request, request.sampling_params.max_tokens
        )


def test_max_num_seqs_caps_the_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner()
    requests = [make_request(f"r{i}", 5, arrival_time=i, max_tokens=3) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    for out in run_to_completion(scheduler, runner):
        assert len(out.num_scheduled_tokens) <= 2
    for request in requests:
        assert request.output_token_ids == reference_outputs(request, 3)
        assert request.status == RequestStatus.FINISHED_LENGTH


def test_pipeline_micro_batches_split_the_requests_and_keep_outputs():
    scheduler = make_scheduler()
    scheduler.num_micro_batches = 2
    runner = FakeRunner()
    requests = [make_request(f"r{i}", 5 + i, arrival_time=i, max_tokens=6) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    in_flight: list[SchedulerOutput] = []
    batch_sizes = []
    while scheduler.has_unfinished_requests() or in_flight:
        unfinished = scheduler.get_num_unfinished_requests()
        out = scheduler.schedule()
        # Each of the two batches takes at most half of the unfinished requests.
        assert len(out.num_scheduled_tokens) <= -(-unfinished // 2)
        if not out.is_empty:
            # A batch never holds a request whose token is still in flight in the other one.
            assert not set(out.num_scheduled_tokens) & {
                r for o in in_flight for r in o.num_scheduled_tokens
            }
            in_flight.append(out)
            batch_sizes.append(len(out.num_scheduled_tokens))
        else:
            scheduler.defer_finished(out)
        if len(in_flight) == 2 or (in_flight and out.is_empty):
            oldest = in_flight.pop(0)
            scheduler.update_from_output(oldest, runner.execute(oldest))
            check_scheduler(scheduler)
    assert batch_sizes[:2] == [3, 2]
    for request in requests:
        assert request.output_token_ids == reference_outputs(request, 6)


def admission_order(scheduler: Scheduler, requests: list[Request]) -> list[str]:
    for request in requests:
        scheduler.add_request(request)
    order = []
    runner = FakeRunner()
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        order += [new.req_id for new in out.scheduled_new_reqs]
    return order


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    # Added in this order; (priority, arrival_time) differ from it on purpose.
    requests = [
        make_request("late-low", 5, priority=2, arrival_time=1.0),
        make_request("late-high", 5, priority=0, arrival_time=3.0),
        make_request("early-mid", 5, priority=1, arrival_time=0.5),
        make_request("early-high", 5, priority=0, arrival_time=2.0),
    ]
    order = admission_order(scheduler, requests)
    assert order == ["early-high", "late-high", "early-mid", "late-low"]


def test_fcfs_policy_admits_in_arrival_order_and_ignores_priority():
    scheduler = make_scheduler(max_num_seqs=1, policy="fcfs")
    requests = [
        make_request(rid, 5, priority=p, arrival_time=float(t))
        for t, (rid, p) in enumerate([("low", 2), ("high", 0), ("mid", 1), ("high2", 0)])
    ]
    order = admission_order(scheduler, requests)
    assert order == ["low", "high", "mid", "high2"]


@pytest.mark.parametrize(
    "specs, victim",
    [
        # (request id, priority, arrival time); all same priority: the latest arrival goes.
        ([("a", 0, 0.0), ("b", 0, 1.0), ("c", 0, 2.0)], "c"),
        # The least urgent goes even though it arrived first.
        ([("a", 5, 0.0), ("b", 0, 1.0), ("c", 0, 2.0)], "a"),
        # Among the least urgent, the later arrival.
        ([("a", 3, 0.0), ("b", 3, 1.0), ("c", 1, 2.0)], "b"),
    ],
)
def test_preemption_picks_least_urgent_then_latest_and_resumes(specs, victim):
    # Each request's 7-token prompt takes 2 blocks; the cache has exactly those blocks, so the
    # first decode that needs a third block must preempt someone.
    scheduler = make_scheduler(
        num_blocks=1 + 2 * len(specs), policy="priority", enable_prefix_caching=False
    )
    runner = FakeRunner()
    requests = {
        rid: make_request(rid, 7, priority=p, arrival_time=t, max_tokens=4) for rid, p, t in specs
    }
    for request in requests.values():
        scheduler.add_request(request)

    preempted_in = None
    outputs = []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        outputs.append(out)
        if scheduler.num_preemptions and preempted_in is None:
            preempted_in = out
            assert requests[victim].status == RequestStatus.PREEMPTED
            assert scheduler.num_preemptions == 1
            assert victim in out.finished_req_ids
            assert victim not in out.num_scheduled_tokens
            num_outputs_at_preemption = requests[victim].num_output_tokens
            assert num_outputs_at_preemption > 0
        assert len(outputs) < 100
    assert preempted_in is not None

    # Resumed as a new request carrying its outputs so far as part of its prefix.
    resumed = [
        new for out in outputs[outputs.index(preempted_in) + 1 :] for new in out.scheduled_new_reqs
    ]
    assert [new.req_id for new in resumed] == [victim]
    assert resumed[0].num_prompt_tokens == 7
    assert resumed[0].token_ids[7:] == reference_outputs(
        requests[victim], num_outputs_at_preemption
    )
    for request in requests.values():
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == reference_outputs(request, 4)
    assert scheduler.kv_cache_manager.usage == 0


def test_fcfs_preempts_the_latest_arrival_and_resumes_it_first():
    scheduler = make_scheduler(num_blocks=5, enable_prefix_caching=False)
    runner = FakeRunner()
    first, second, third = (
        make_request(rid, 7, arrival_time=float(t), max_tokens=4)
        for t, rid in enumerate(["first", "second", "third"])
    )
    for request in (first, second, third):
        scheduler.add_request(request)
    admitted = []
    for out in run_to_completion(scheduler, runner):
        admitted += [new.req_id for new in out.scheduled_new_reqs]
    # second is preempted when first needs a third block, and goes back ahead of third.
    assert scheduler.num_preemptions == 1
    assert admitted == ["first", "second", "second", "third"]
    for request in (first, second, third):
        assert request.output_token_ids == reference_outputs(request, 4)


def test_a_request_can_preempt_itself():
    scheduler = make_scheduler(num_blocks=5, policy="priority", enable_prefix_caching=False)
    runner = FakeRunner()
    urgent = make_request("urgent", 5, priority=0, arrival_time=1.0, max_tokens=3)
    lazy = make_request("lazy", 7, priority=1, arrival_time=0.0, max_tokens=3)
    scheduler.add_request(lazy)
    scheduler.add_request(urgent)
    step(scheduler, runner)
    assert [r.request_id for r in scheduler.running] == ["urgent", "lazy"]
    step(scheduler, runner)
    # lazy now needs a third block and none is free; it is the least urgent, so it gives up
    # its own blocks while urgent (still inside its second block) runs on.
    out, _ = step(scheduler, runner)
    assert list(out.num_scheduled_tokens) == ["urgent"]
    assert lazy.status == RequestStatus.PREEMPTED
    run_to_completion(scheduler, runner)
    assert lazy.output_token_ids == reference_outputs(lazy, 3)


def test_preempting_a_request_already_scheduled_this_step_refunds_it():
    # 4 usable blocks; a budget of 6 tokens.
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=6, policy="priority")
    runner = FakeRunner()
    lazy = make_request("lazy", 3, priority=1, arrival_time=0.0, max_tokens=3)
    scheduler.add_request(lazy)
    step(scheduler, runner)
    urgent = make_request("urgent", 4, priority=0, arrival_time=1.0, max_tokens=3)
    third = make_request("third", 6, priority=0, arrival_time=2.0, max_tokens=3)
    scheduler.add_request(urgent)
    scheduler.add_request(third)
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"lazy": 1, "urgent": 4, "third": 1}

    # lazy, first in the batch, takes the last free block; then urgent needs one, and lazy
    # is the least urgent: preempted although already scheduled. Its token goes back to
    # the budget, and third (after the victim in the batch) still gets its chunk.
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"urgent": 1, "third": 5}
    assert "lazy" in out.finished_req_ids
    assert lazy.status == RequestStatus.PREEMPTED
    run_to_completion(scheduler, runner)
    for request in (lazy, urgent, third):
        assert request.output_token_ids == reference_outputs(request, 3)


@pytest.mark.parametrize(
    "params, sampled, want_outputs, want_reason, want_stop_reason",
    [
        ({"max_tokens": 10}, [5, 6, EOS, 7], [5, 6, EOS], "stop", None),
        ({"max_tokens": 4, "ignore_eos": True}, [EOS] * 5, [EOS] * 4, "length", None),
        ({"max_tokens": 10, "stop_token_ids": [9]}, [5, 9, 6], [5, 9], "stop", 9),
        ({"max_tokens": 10, "min_tokens": 3}, [EOS] * 5, [EOS] * 3, "stop", None),
        ({"max_tokens": 10, "min_tokens": 2, "stop_token_ids": [9]}, [9, 9, 9], [9, 9], "stop", 9),
        ({"max_tokens": 3}, [5, 6, 7, 8], [5, 6, 7], "length", None),
    ],
)
def test_stop_conditions(params, sampled, want_outputs, want_reason, want_stop_reason):
    scheduler = make_scheduler()
    tokens = iter(sampled)
    runner = FakeRunner(sample=lambda req_id, token_ids: next(tokens))
    request = make_request("r", 5, **params)
    scheduler.add_request(request)
    run_to_completion(scheduler, runner)
    assert request.output_token_ids == want_outputs
    assert request.status.is_finished and request.status.finish_reason == want_reason
    assert request.stop_reason == want_stop_reason
    assert scheduler.kv_cache_manager.usage == 0


def test_no_eos_token_means_no_eos_stop():
    scheduler = make_scheduler()
    runner = FakeRunner(sample=lambda req_id, token_ids: EOS)
    request = make_request("r", 5, eos_token_id=None, max_tokens=4)
    scheduler.add_request(request)
    run_to_completion(scheduler, runner)
    assert request.output_token_ids == [EOS] * 4


def test_max_model_len_caps_generation():
    scheduler = make_scheduler(max_model_len=14)
    runner = FakeRunner()
    request = make_request("r", 10, max_tokens=None)
    scheduler.add_request(request)
    run_to_completion(scheduler, runner)
    assert request.num_tokens == 14
    assert request.status.finish_reason == "length"


def test_updated_requests_are_returned_with_their_final_status():
    scheduler = make_scheduler()
    runner = FakeRunner()
    request = make_request("r", 5, max_tokens=1)
    scheduler.add_request(request)
    out, updated = step(scheduler, runner)
    assert updated == [request]
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert not scheduler.has_unfinished_requests()
    # The workers learn about the finish in the next step's output.
    assert "r" in scheduler.schedule().finished_req_ids


def test_finish_requests_frees_blocks():
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeRunner()
    running = make_request("running", 9, max_tokens=50)
    waiting = make_request("waiting", 9, max_tokens=50)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler, runner)
    assert scheduler.kv_cache_manager.usage > 0

    scheduler.finish_requests(["running", "unknown"], RequestStatus.FINISHED_ABORTED)
    check_scheduler(scheduler)
    assert running.status.finish_reason == "abort"
    assert scheduler.kv_cache_manager.usage == 0
    assert scheduler.get_num_unfinished_requests() == 1
    # Finishing again is a no-op.
    scheduler.finish_requests("running", RequestStatus.FINISHED_STOPPED)
    assert running.status == RequestStatus.FINISHED_ABORTED

    out, _ = step(scheduler, runner)
    assert "running" in out.finished_req_ids
    assert [new.req_id for new in out.scheduled_new_reqs] == ["waiting"]
    scheduler.finish_requests(["waiting"], RequestStatus.FINISHED_STOPPED)
    check_scheduler(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0

    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests(["x"], RequestStatus.RUNNING)


def test_aborting_a_waiting_request_before_it_ever_ran():
    scheduler = make_scheduler()
    request = make_request("r", 5)
    scheduler.add_request(request)
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().is_empty


def test_prefix_hits_skip_computed_blocks():
    scheduler = make_scheduler()
    runner = FakeRunner()
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks
    first = make_request("first", prompt, max_tokens=2)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)
    second = make_request("second", prompt, max_tokens=2)
    scheduler.add_request(second)
    out, _ = step(scheduler, runner)
    assert second.num_cached_tokens == 20
    assert out.scheduled_new_reqs[0].num_computed_tokens == 20
    assert out.num_scheduled_tokens == {"second": 1}
    run_to_completion(scheduler, runner)
    assert second.output_token_ids == first.output_token_ids
    stats = scheduler.stats()
    assert stats["prefix_cache_queries"] == 42 and stats["prefix_cache_hits"] == 20
    assert stats["kv_cache_usage"] == 0


def test_requests_admitted_together_share_their_prompt_blocks():
    scheduler = make_scheduler()
    runner = FakeRunner()
    prompt = list(range(10, 27))  # 17 tokens: 4 full blocks
    samples = [make_request(f"s{i}", prompt, max_tokens=3) for i in range(3)]
    for request in samples:
        scheduler.add_request(request)
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"s0": 17, "s1": 1, "s2": 1}
    assert [r.num_cached_tokens for r in samples] == [0, 16, 16]
    # 4 shared blocks + one private last block each.
    assert scheduler.kv_cache_manager.usage * 64 == 4 + 3
    run_to_completion(scheduler, runner)
    for request in samples:
        assert request.output_token_ids == reference_outputs(request, 3)


def test_different_cache_salts_do_not_share():
    scheduler = make_scheduler()
    runner = FakeRunner()
    prompt = list(range(10, 27))
    a = make_request("a", prompt, cache_salt="tenant-a")
    b = make_request("b", prompt, cache_salt="tenant-b")
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_to_completion(scheduler, runner)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0


def test_requests_that_can_never_fit_are_rejected():
    scheduler = make_scheduler(num_blocks=5, max_model_len=64)  # the cache holds 16 tokens
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.check_request(make_request("long", 64))
    with pytest.raises(ValueError, match="KV cache"):
        scheduler.check_request(make_request("big", 17))
    with pytest.raises(ValueError, match="empty"):
        scheduler.check_request(make_request("empty", []))
    scheduler.check_request(make_request("fits", 16))
    scheduler.add_request(make_request("r", 5))
    with pytest.raises(ValueError, match="already"):
        scheduler.add_request(make_request("r", 5))


def test_generation_past_the_whole_cache_ends_instead_of_hanging():
    scheduler = make_scheduler(num_blocks=5, max_model_len=64)  # the cache holds 16 tokens
    runner = FakeRunner()
    request = make_request("r", 10, max_tokens=None)
    scheduler.add_request(request)
    run_to_completion(scheduler, runner, max_steps=50)
    assert request.status.finish_reason == "length"
    assert request.num_tokens == 17


def test_waiting_request_that_does_not_fit_now_waits():
    scheduler = make_scheduler(num_blocks=5, max_model_len=64)
    runner = FakeRunner()
    first = make_request("first", 12, arrival_time=0.0, max_tokens=2)
    second = make_request("second", 12, arrival_time=1.0, max_tokens=2)
    scheduler.add_request(first)
    scheduler.add_request(second)
    out, _ = step(scheduler, runner)
    assert list(out.num_scheduled_tokens) == ["first"]
    run_to_completion(scheduler, runner)
    assert second.output_token_ids == reference_outputs(second, 2)


@pytest.mark.parametrize("seed", range(10))
def test_random_workload_matches_unscheduled_generation(seed):
    rng = random.Random(seed)
    policy = rng.choice(["fcfs", "priority"])
    scheduler = make_scheduler(
        num_blocks=rng.randint(11, 20),
        max_num_batched_tokens=rng.choice([8, 16, 32]),
        max_num_seqs=rng.randint(2, 8),
        max_model_len=40,
        policy=policy,
        enable_prefix_caching=rng.random() < 0.8,
        max_prefill_tokens_with_decodes=rng.choice([None, 0, 3, 8]),
    )
    runner = FakeRunner()
    shared = [rng.randint(10, 59) for _ in range(12)]
    requests = []
    aborted = set()
    for i in range(40):
        if rng.random() < 0.6:
            n = rng.randint(1, 20)
            prompt = (shared if rng.random() < 0.5 else [])[: rng.randint(0, 12)]
            prompt = prompt + [rng.randint(10, 59) for _ in range(n)]
            request = make_request(
                f"r{i}",
                prompt[:30],
                priority=rng.randint(0, 3),
                arrival_time=float(i),
                max_tokens=rng.randint(1, 25),
                cache_salt=rng.choice([None, None, "t1"]),
            )
            scheduler.add_request(request)
            requests.append(request)
        if requests and rng.random() < 0.05:
            victim = rng.choice(requests)
            if not victim.is_finished:
                aborted.add(victim.request_id)
            scheduler.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
            check_scheduler(scheduler)
        step(scheduler, runner)
    run_to_completion(scheduler, runner)
    for request in requests:
        want = reference_outputs(request, request.sampling_params.max_tokens)
        want = want[: 40 - request.num_prompt_tokens]
        if request.request_id in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            assert request.output_token_ids == want[: request.num_output_tokens]
        else:
            assert request.status == RequestStatus.FINISHED_LENGTH
            assert request.output_token_ids == want
    assert scheduler.kv_cache_manager.usage == 0


def sample_of_index(req_id: str, token_ids: list[int]) -> int:
    """Like next_token, but sample `r#i` of a request draws its own tokens: a sample that
    wrote into its sibling's block would corrupt the sibling's KV."""
    index = int(req_id.rsplit("#", 1)[1]) if "#" in req_id else 0
    return 10 + (sum(token_ids[-3:]) * 31 + len(token_ids) + 7 * index) % 50


def reference_sample(request: Request, num_tokens: int) -> list[int]:
    token_ids = list(request.prompt_token_ids)
    for _ in range(num_tokens):
        token_ids.append(sample_of_index(request.request_id, token_ids))
    return token_ids[request.num_prompt_tokens :]


def add_samples(scheduler: Scheduler, prompt: list[int], n: int, name: str = "r", **params):
    samples = [make_request(f"{name}#{i}", prompt, **params) for i in range(n)]
    for sample in samples:
        scheduler.add_request(
            sample, fork_of=None if sample is samples[0] else samples[0].request_id
        )
    return samples


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
@pytest.mark.parametrize("prompt_len", [9, 10, 8])
def test_samples_fork_the_first_samples_prompt_blocks(enable_prefix_caching, prompt_len):
    scheduler = make_scheduler(enable_prefix_caching=enable_prefix_caching)
    runner = FakeRunner(sample_of_index)
    prompt = list(range(20, 20 + prompt_len))
    samples = add_samples(scheduler, prompt, 4, max_tokens=3)
    out, _ = step(scheduler, runner)
    assert list(out.num_scheduled_tokens) == ["r#0"]  # the others wait for its prompt
    out, _ = step(scheduler, runner)
    # Each fork computes only the prompt's last token, beside the first sample's decode.
    assert out.num_scheduled_tokens == {"r#0": 1, "r#1": 1, "r#2": 1, "r#3": 1}
    kv = scheduler.kv_cache_manager
    # The full blocks before the last prompt token's are shared by all four: held once.
    num_shared = (prompt_len - 1) // BLOCK_SIZE
    tables = [kv.get_block_ids(s) for s in samples]
    assert all(t[:num_shared] == tables[0][:num_shared] for t in tables)
    # The block of the last prompt token: copied for each fork when it holds earlier tokens.
    partial = (prompt_len - 1) % BLOCK_SIZE != 0
    assert len(out.blocks_to_copy) == (3 if partial else 0)
    assert kv.num_shared_blocks() == num_shared
    # The first sample's blocks (its decode may have opened one more) plus each fork's own.
    first_blocks = cdiv_(prompt_len + 1, BLOCK_SIZE)
    fork_blocks = cdiv_(prompt_len, BLOCK_SIZE) - num_shared
    assert kv.usage * kv.block_pool.num_usable_blocks == first_blocks + 3 * fork_blocks
    run_to_completion(scheduler, runner)
    for sample in samples:
        assert sample.output_token_ids == reference_sample(sample, 3)
    assert kv.usage == 0


def cdiv_(a: int, b: int) -> int:
    return -(a // -b)


def test_samples_whose_first_sample_finishes_before_they_fork_compute_their_prompt():
    scheduler = make_scheduler(enable_prefix_caching=False)
    runner = FakeRunner(sample_of_index)
    samples = add_samples(scheduler, list(range(30, 39)), 3, max_tokens=1)
    # The first sample's one token ends it when its prompt step completes: in a synchronous
    # loop that is before the next schedule, so the others admit as new requests.
    run_to_completion(scheduler, runner)
    for sample in samples:
        assert sample.output_token_ids == reference_sample(sample, 1)


def test_aborting_one_sample_leaves_the_others_and_frees_only_its_blocks():
    scheduler = make_scheduler(enable_prefix_caching=False)
    runner = FakeRunner(sample_of_index)
    samples = add_samples(scheduler, list(range(40, 51)), 3, max_tokens=6)
    step(scheduler, runner)
    step(scheduler, runner)
    shared = scheduler.kv_cache_manager.get_block_ids(samples[0])[:2]
    scheduler.finish_requests("r#1", RequestStatus.FINISHED_ABORTED)
    check_scheduler(scheduler)
    assert [scheduler.kv_cache_manager.block_pool.blocks[b].ref_cnt for b in shared] == [2, 2]
    # Aborting a sample that still waits to fork.
    late = add_samples(scheduler, list(range(60, 70)), 2, name="q", max_tokens=6)
    scheduler.finish_requests("q#1", RequestStatus.FINISHED_ABORTED)
    check_scheduler(scheduler)
    run_to_completion(scheduler, runner)
    for sample in (samples[0], samples[2], late[0]):
        assert sample.output_token_ids == reference_sample(sample, 6)
    assert scheduler.kv_cache_manager.usage == 0


def test_a_forked_request_continues_its_parent_and_shares_its_blocks():
    scheduler = make_scheduler(enable_prefix_caching=False)
    runner = FakeRunner()
    parent = make_request("p", list(range(10, 20)), max_tokens=20)
    scheduler.add_request(parent)
    step(scheduler, runner)
    assert parent.num_computed_tokens == 10 and parent.num_output_tokens == 1
    # Two continuations of the parent's computed tokens, each with another next token.
    children = []
    for i, token in enumerate((33, 44)):
        child = make_request(f"c{i}", list(range(10, 20)) + [token], max_tokens=3)
        scheduler.fork_request(parent, child)
        children.append(child)
    scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    check_scheduler(scheduler)
    out, _ = step(scheduler, runner)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["c0", "c1"]
    assert out.num_scheduled_tokens == {"c0": 1, "c1": 1}
    assert len(out.blocks_to_copy) == 1  # the first copies, the second keeps the block
    run_to_completion(scheduler, runner)
    for child in children:
        assert child.output_token_ids == reference_outputs(child, 3)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_of_forked_samples_matches_unscheduled_generation(seed):
    rng = random.Random(seed)
    scheduler = make_scheduler(
        num_blocks=rng.randint(11, 16),
        max_num_batched_tokens=rng.choice([8, 16, 32]),
        max_num_seqs=rng.randint(4, 8),
        max_model_len=40,
        enable_prefix_caching=seed % 2 == 0,
    )
    runner = FakeRunner(sample_of_index)
    groups, aborted = [], set()
    for i in range(30):
        if rng.random() < 0.5:
            prompt = [rng.randint(10, 59) for _ in range(rng.randint(1, 18))]
            samples = add_samples(
                scheduler,
                prompt,
                rng.randint(1, 4),
                name=f"g{i}",
                arrival_time=float(i),
                max_tokens=rng.randint(1, 22),
            )
            groups.append(samples)
        if groups and rng.random() < 0.1:
            victim = rng.choice(rng.choice(groups))
            if not victim.is_finished:
                aborted.add(victim.request_id)
            scheduler.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
            check_scheduler(scheduler)
        step(scheduler, runner)
    run_to_completion(scheduler, runner)
    for sample in (s for g in groups for s in g):
        want = reference_sample(sample, sample.sampling_params.max_tokens)
        want = want[: 40 - sample.num_prompt_tokens]
        if sample.request_id in aborted:
            assert sample.output_token_ids == want[: sample.num_output_tokens]
        else:
            assert sample.output_token_ids == want
    assert scheduler.kv_cache_manager.usage == 0
    assert scheduler.num_preemptions > 0  # forks run short of blocks and get preempted


def test_preempting_a_forked_sample_keeps_the_blocks_the_others_hold():
    scheduler = make_scheduler(enable_prefix_caching=False)
    runner = FakeRunner(sample_of_index)
    samples = add_samples(scheduler, list(range(20, 31)), 3, max_tokens=8)
    step(scheduler, runner)
    step(scheduler, runner)
    kv = scheduler.kv_cache_manager
    shared = kv.get_block_ids(samples[0])[:2]
    assert [kv.block_pool.blocks[b].ref_cnt for b in shared] == [3, 3]
    scheduler._preempt(samples[2])  # as the scheduler does when blocks run out
    check_scheduler(scheduler)
    assert [kv.block_pool.blocks[b].ref_cnt for b in shared] == [2, 2]
    assert samples[2] in scheduler.waiting and kv.get_block_ids(samples[2]) == []
    run_to_completion(scheduler, runner)
    for sample in samples:
        assert sample.output_token_ids == reference_sample(sample, 8)
    assert kv.usage == 0
