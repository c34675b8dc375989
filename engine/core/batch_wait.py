"""Dynamic batching (`batch_wait_timeout_ms`): how long new requests are still held back.

The rule, in one place. New requests wait in the queue, unadmitted, so that more arrivals
join the step that computes their prompts, while all of these hold:

- the timeout is on (> 0);
- a request waits and none is swapped out (a swapped request resumes at once);
- the oldest waiting request arrived less than the timeout ago;
- the batch is not full: fewer than `max_num_seqs` requests running and waiting, and less
  than one step's `max_num_batched_tokens` of prompt waiting.

While they hold, running requests go on decoding (the step admits no one), and with none
running the engine loop waits for arrivals instead of stepping (engine/core_loop.py). The
hold ends at the oldest waiting request's arrival plus the timeout, or at the arrival that
fills the batch: no request's admission moves later than that, so the timeout bounds what
it adds to any request's time to first token. A request preempted back into the queue
keeps its first arrival, so it is never held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Waiting(Protocol):
    arrival_time: float
    num_tokens: int
    num_computed_tokens: int


def batch_wait_left(
    timeout_s: float,
    now: float,
    waiting: Sequence[_Waiting],
    num_running: int,
    num_swapped: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> float:
    """Seconds new requests are still held back at `now` (monotonic); 0: admit them now."""
    if timeout_s <= 0 or not waiting or num_swapped:
        return 0.0
    left = min(r.arrival_time for r in waiting) + timeout_s - now
    if left <= 0 or num_running + len(waiting) >= max_num_seqs:
        return 0.0
    prompt_tokens = 0
    for request in waiting:
        prompt_tokens += request.num_tokens - request.num_computed_tokens
        if prompt_tokens >= max_num_batched_tokens:
            return 0.0
    return left
