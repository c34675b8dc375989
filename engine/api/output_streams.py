"""Reading the engine's output streams for one API request: its time limit, the engine's
errors as `APIError`s, and the streams of a request's several prompts merged."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from engine.api.protocol import APIError
from engine.async_engine import EngineDeadError
from engine.outputs import RequestOutput
from engine.sampling_params import StructuredOutputError


def loop_deadline(deadline: float | None) -> float | None:
    """A wall-clock deadline (time.time()) on the running loop's clock."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.time())


async def next_output(
    outputs: AsyncIterator, deadline: float | None, structured: str = "response_format"
) -> Any:
    """The next item, None at the end; engine errors become APIErrors (a structured output
    the engine refuses names the request's field `structured`)."""
    try:
        if deadline is None:
            return await anext(outputs)
        async with asyncio.timeout_at(deadline):
            return await anext(outputs)
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
