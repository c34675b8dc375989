"""Dynamic batching (batch_wait_timeout_ms): the hold rule on a fake clock, and the
scheduler admitting nothing new while it holds. No model."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineArgs, SchedulerConfig
from engine.core.batch_wait import batch_wait_left
from engine.core.scheduler import Scheduler
from tests.unit.test_scheduler import BLOCK_SIZE, FakeRunner, make_request


def _scheduler(timeout_ms: float, max_num_seqs: int = 4, tokens: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=tokens,
            max_model_len=256,
            batch_wait_timeout_ms=timeout_ms,
        ),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        65,
    )


def test_the_hold_runs_from_the_oldest_arrival_and_never_past_the_timeout():
    sched = _scheduler(timeout_ms=50)
    sched.add_request(make_request("b", 5, arrival_time=10.02))
    sched.add_request(make_request("a", 5, arrival_time=10.0))
    assert sched.batch_wait_left(10.0) == pytest.approx(0.05)
    assert sched.batch_wait_left(10.03) == pytest.approx(0.02)
    # The timeout counts from "a", the oldest, not from the last arrival.
    assert sched.batch_wait_left(10.05) == 0.0
    assert sched.batch_wait_left(11.0) == 0.0


def test_a_full_batch_is_never_held():
    sched = _scheduler(timeout_ms=1000, max_num_seqs=3)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", 5, arrival_time=0.0))
    assert sched.batch_wait_left(0.0) > 0
    sched.add_request(make_request("r2", 5, arrival_time=0.0))  # 3 of max_num_seqs 3
    assert sched.batch_wait_left(0.0) == 0.0
    # A step's worth of prompt tokens waiting fills the batch as well.
    sched = _scheduler(timeout_ms=1000, tokens=16)
    sched.add_request(make_request("long", 16, arrival_time=0.0))
    assert sched.batch_wait_left(0.0) == 0.0


def test_running_requests_count_toward_a_full_batch():
    assert batch_wait_left(1.0, 0.0, [_Req(0.0)], 3, 0, 4, 64) == 0.0
    assert batch_wait_left(1.0, 0.0, [_Req(0.0)], 2, 0, 4, 64) == 1.0
    assert batch_wait_left(1.0, 0.0, [_Req(0.0)], 2, 1, 4, 64) == 0.0  # one swapped out


def test_the_timeout_in_force_can_change_between_steps():
    sched = _scheduler(timeout_ms=0)
    sched.add_request(make_request("a", 5, arrival_time=0.0))
    sched.batch_wait_timeout_s = 0.02  # LLMEngine.set_batch_wait_timeout_ms(20)
    assert sched.batch_wait_left(0.0) == pytest.approx(0.02)


def test_off_never_holds():
    sched = _scheduler(timeout_ms=0)
    sched.add_request(make_request("a", 5, arrival_time=0.0))
    assert sched.batch_wait_left(0.0) == 0.0
    assert EngineArgs().batch_wait_timeout_ms == 0


def test_held_requests_are_admitted_in_one_step_while_running_ones_go_on():
    sched, runner = _scheduler(timeout_ms=50), FakeRunner()
    sched.add_request(make_request("first", 5, arrival_time=0.0, max_tokens=20))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert sched.num_admitting_steps == 1
    # Two arrivals within the window: the steps go on for "first" alone, then both start
    # in one step once the window ends.
    sched.add_request(make_request("a", 5, arrival_time=1.0))
    sched.add_request(make_request("b", 5, arrival_time=1.01))
    for now in (1.0, 1.02, 1.04):
        held = sched.batch_wait_left(now) > 0
        assert held
        out = sched.schedule(admit_new=not held)
        assert set(out.num_scheduled_tokens) == {"first"}
        sched.update_from_output(out, runner.execute(out))
    assert sched.batch_wait_left(1.05) == 0.0
    out = sched.schedule(admit_new=True)
    assert {r.req_id for r in out.scheduled_new_reqs} == {"a", "b"}
    assert sched.num_admitting_steps == 2


@pytest.mark.parametrize("value", [-1, "soon", float("nan"), float("inf")])
def test_a_bad_timeout_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match="batch_wait_timeout_ms"):
        EngineArgs(batch_wait_timeout_ms=value)


class _Req:
    def __init__(self, arrival_time: float, num_tokens: int = 5) -> None:
        self.arrival_time, self.num_tokens, self.num_computed_tokens = arrival_time, num_tokens, 0
