"""A request's time limit (engine.api.output_streams.TimeLimit): a 408 once it passes,
whether the request waits for the engine then or not, and never in place of a
cancellation that is not its own (a client that went away)."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import pytest

from engine.api.errors import APIError
from engine.api.output_streams import TimeLimit, next_output


async def _slow(delays: list[float]):
    for i, delay in enumerate(delays):
        await asyncio.sleep(delay)
        yield i


def test_a_wait_past_the_limit_is_a_408_and_closes_the_stream():
    closed = []

    async def outputs():
        try:
            yield 0
            await asyncio.sleep(10)
            yield 1
        finally:
            closed.append(True)

    async def go():
        limit = TimeLimit(time.time() + 0.2)
        stream = outputs()
        assert await next_output(stream, limit) == 0
        start = time.monotonic()
        with pytest.raises(APIError) as info:
            await next_output(stream, limit)
        return info.value, time.monotonic() - start

    error, waited = asyncio.run(go())
    assert error.status_code == 408 and error.code == "request_timeout"
    assert "request_timeout_s" in str(error)
    assert waited < 1.0
    assert closed == [True]  # the engine's generator ran its cleanup (its request aborts)


def test_a_limit_that_passed_while_the_caller_was_busy_fails_the_next_wait():
    async def go():
        limit = TimeLimit(time.time() + 0.05)
        stream = _slow([0, 0, 0])
        assert await next_output(stream, limit) == 0
        await asyncio.sleep(0.15)  # e.g. sending a chunk to a slow client
        with pytest.raises(APIError) as info:
            await next_output(stream, limit)
        return info.value.status_code

    assert asyncio.run(go()) == 408


def test_outputs_within_the_limit_come_through_and_no_limit_never_fires():
    async def go(deadline):
        limit = TimeLimit(deadline)
        stream = _slow([0.01] * 5)
        items = []
        while (item := await next_output(stream, limit)) is not None:
            items.append(item)
        limit.cancel()
        return items

    assert asyncio.run(go(time.time() + 5)) == [0, 1, 2, 3, 4]
    assert asyncio.run(go(None)) == [0, 1, 2, 3, 4]


def test_a_cancellation_that_is_not_the_limit_s_stays_a_cancellation():
    async def go():
        limit = TimeLimit(time.time() + 0.1)
        task = asyncio.create_task(next_output(_slow([10]), limit))
        await asyncio.sleep(0.02)
        task.cancel()  # the client went away before the limit
        with pytest.raises(asyncio.CancelledError):
            await task
        # The limit firing later must not cancel a task that no longer waits on it.
        await asyncio.sleep(0.15)
        return limit.expired

    assert asyncio.run(go()) is True


@pytest.mark.parametrize("limit_first", [True, False])
def test_a_cancellation_at_the_same_time_as_the_limit_stays_a_cancellation(limit_first):
    async def go():
        limit = TimeLimit(time.time() + 600)
        task = asyncio.create_task(next_output(_slow([10]), limit))
        await asyncio.sleep(0.02)
        # The limit fires and the task is cancelled from outside in the same turn (the
        # request is being torn down): the outside cancellation must come through.
        if limit_first:
            limit._expire()
            task.cancel()
        else:
            task.cancel()
            limit._expire()
        with pytest.raises(asyncio.CancelledError):
            await task
        limit.cancel()

    asyncio.run(go())


def test_a_request_dropped_unread_is_not_kept_alive_by_its_limit():
    async def go():
        limit = TimeLimit(time.time() + 600)
        ref = weakref.ref(limit)
        del limit
        gc.collect()
        return ref() is None

    assert asyncio.run(go())
