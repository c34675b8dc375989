"""A probe for tests of overlapped and pipelined steps."""

from __future__ import annotations


def record_steps_in_flight(engine) -> list[int]:
    """Wrap the engine's executor: each launch appends how many launched steps the engine
    has not read back yet (1: the new step overlaps one in flight)."""
    counts: list[int] = []
    launch = engine.executor.execute_model_async

    def recording_launch(scheduler_output):
        counts.append(len(engine._pending))
        return launch(scheduler_output)

    engine.executor.execute_model_async = recording_launch
    return counts
