"""Reading the engine's output streams for one API request: its time limit, the engine's
errors as `APIError`s, and the streams of a request's several prompts merged."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from engine.api.errors import APIError
from engine.async_engine import EngineDeadError
from engine.outputs import RequestFailedError, RequestOutput
from engine.sampling_params import StructuredOutputError


class TimeLimit:
    """A request's time limit (request_timeout_s): one timer for the request's whole life.

    `asyncio.timeout` around each wait for an output schedules and cancels a timer per
    output on the serving loop (a token at a time, for every stream). Here the timer is set once; when it fires while the request's task waits in
    `next_output`, it cancels that wait, as `asyncio.timeout` does, and the wait becomes a
    408; a later `next_output` gives the 408 at once.
    """

    def __init__(self, deadline: float | None) -> None:
        """`deadline`: wall-clock time (time.time()), None for no limit."""
        self.expired = False
        self._waiter: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        if deadline is not None:
            loop = asyncio.get_running_loop()
            # The timer holds the limit weakly: a request dropped unread leaves no more
            # than the timer itself behind.
            self._timer = loop.call_at(
                loop.time() + (deadline - time.time()), _expire, weakref.ref(self)
            )

    def _expire(self) -> None:
        self.expired = True
        if self._waiter is not None:
            self._waiter.cancel()

    def cancel(self) -> None:
        """The request is over: drop the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def wait(self, outputs: AsyncIterator) -> Any:
        """anext(outputs), or TimeoutError once the limit has passed."""
        if self.expired:
            raise TimeoutError
        if self._timer is None:
            return await anext(outputs)
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        self._waiter = task
        try:
            return await anext(outputs)
        except asyncio.CancelledError:
            # Ours only if the limit fired and no one else cancelled the task meanwhile.
            if self.expired and task.uncancel() <= cancelling:
                raise TimeoutError from None
            raise
        finally:
            self._waiter = None


def _expire(limit: weakref.ref) -> None:
    target = limit()
    if target is not None:
        target._expire()


async def next_output(
    outputs: AsyncIterator, limit: TimeLimit, structured: str = "response_format"
) -> Any:
    """The next item, None at the end; engine errors become APIErrors (a structured output
    the engine refuses names the request's field `structured`)."""
    try:
        return await limit.wait(outputs)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        raise APIError(
            "the request ran past its time limit (request_timeout_s) and was aborted",
            408,
            code="request_timeout",
        ) from None
    except EngineDeadError as e:
        raise APIError(f"the engine is not running: {e}", 503, code="engine_dead") from None
    except RequestFailedError as e:
        raise APIError(f"the engine could not finish the request: {e}", 500) from None
    except StructuredOutputError as e:
        # The engine names its own field (structured_output); the client sent `structured`.
        reason = str(e).removeprefix("structured_output: ")
        raise APIError(f"{structured}: {reason}", param=structured) from None
    except ValueError as e:
        raise APIError(str(e)) from None


async def merge_streams(
    gens: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several engine streams as they come, each stream's first
    output (the engine took its prompt) before any other: a prompt the engine refuses fails
    the request as a whole, before a response could have started."""
    if len(gens) == 1:
        async with aclosing(gens[0]) as gen:
            async for output in gen:
                yield 0, output
        return
    pending = {asyncio.ensure_future(anext(gen)): i for i, gen in enumerate(gens)}
    try:
        await asyncio.wait(pending)
        firsts = sorted(pending.items(), key=lambda item: item[1])
        pending = {}
        errors = [task.exception() for task, _ in firsts]
        for error in errors:
            if error is not None and not isinstance(error, StopAsyncIteration):
                raise error
        for (task, i), error in zip(firsts, errors, strict=True):
            if error is None:
                pending[asyncio.ensure_future(anext(gens[i]))] = i
                yield i, task.result()
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(gens[i]))] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for gen in gens:
            await gen.aclose()
