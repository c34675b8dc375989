"""A serving process's start-up heap is out of the garbage collector's reach, and a slow
collection is reported."""

from __future__ import annotations

import gc
import logging
import os

import pytest

from engine.observability import gc_pauses


@pytest.fixture(autouse=True)
def _own_collector_callbacks(monkeypatch):
    """The test process leaves with the collector callbacks and thresholds it came with."""
    callbacks = list(gc.callbacks)
    threshold = gc.get_threshold()
    monkeypatch.setattr(gc_pauses, "_threshold_s", None)
    yield
    gc.callbacks[:] = callbacks
    gc.set_threshold(*threshold)


def test_a_frozen_start_up_is_not_walked_by_later_collections():
    before_start = [[i] for i in range(100)]
    try:
        gc_pauses.freeze_startup_heap()
        after_start = [[i] for i in range(100)]
        tracked = {id(o) for o in gc.get_objects()}
        # A collection walks the objects the collector tracks: only what came later.
        assert not any(id(o) in tracked for o in before_start)
        assert all(id(o) in tracked for o in after_start)
    finally:
        gc.unfreeze()


def test_a_collection_over_the_threshold_is_logged(caplog):
    gc_pauses.warn_of_slow_collections(threshold_s=0.0)
    with caplog.at_level(logging.WARNING, logger="engine.observability.gc_pauses"):
        gc.collect()
    assert "garbage collection (generation 2" in caplog.text
    assert f"(pid {os.getpid()})" in caplog.text
    caplog.clear()
    gc_pauses.warn_of_slow_collections(threshold_s=60.0)
    with caplog.at_level(logging.WARNING, logger="engine.observability.gc_pauses"):
        gc.collect()
    assert "garbage collection" not in caplog.text


def test_offline_generate_keeps_the_callers_heap_from_the_collector_only_while_it_runs():
    from engine import LLM, SamplingParams

    llm = LLM("tiny-llama", load_format="dummy", max_model_len=64, num_gpu_blocks=64)
    callers = [[i] for i in range(100)]
    frozen_during_steps = []
    step = llm.engine.step

    def recording_step():
        frozen_during_steps.append(gc.get_freeze_count())
        return step()

    llm.engine.step = recording_step
    outputs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    assert frozen_during_steps and min(frozen_during_steps) > 100
    # Afterwards the collector walks the caller's objects again.
    assert gc.get_freeze_count() == 0
    tracked = {id(o) for o in gc.get_objects()}
    assert all(id(o) in tracked for o in callers)


def _full_collections_while_requests_pile_up() -> int:
    """Full collections while 1,000,000 long-lived objects accumulate (requests in flight),
    with the heap before frozen, as in a serving process."""
    count = 0

    def count_full(phase: str, info: dict) -> None:
        nonlocal count
        if phase == "stop" and info["generation"] == 2:
            count += 1

    gc.freeze()
    gc.collect()  # the oldest generation now holds nothing but what comes next
    gc.callbacks.append(count_full)
    try:
        in_flight = [[i] for i in range(1_000_000)]
    finally:
        gc.callbacks.remove(count_full)
        gc.unfreeze()
    del in_flight
    return count


def test_a_serving_process_has_ten_times_fewer_full_collections():
    gc.set_threshold(700, 10, 10)  # Python's default
    default = _full_collections_while_requests_pile_up()
    gc_pauses.space_out_full_collections()
    assert gc.get_threshold() == (700, 10, gc_pauses.FULL_COLLECTION_EVERY)
    spaced = _full_collections_while_requests_pile_up()
    assert default >= 5
    assert spaced <= default // 5
