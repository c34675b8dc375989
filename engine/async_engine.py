"""AsyncEngine: the engine core loop in its own thread, with one asyncio stream per request.

`LLMEngine` is synchronous and single-threaded: `add_request`, `abort_request` and `step`
all run on the loop thread. Callers on an event loop queue their requests and aborts; the
thread applies them between steps and hands outputs back with one
`loop.call_soon_threadsafe` per step.

Outputs are cumulative, so a stream keeps only the newest one: a consumer slower than the
engine skips intermediate states and loses nothing (its next delta is simply larger).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The core loop has stopped (step() raised, or shutdown); every request fails with it."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    sampling_params: SamplingParams
    priority: int
    cache_salt: str | None
    stream: _Stream


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run `fn(engine)` on the loop thread (engine state is only safe to read there)."""

    fn: Any
    future: concurrent.futures.Future


class _Stream:
    """The newest output of one request, read on the event loop that asked for it."""

    __slots__ = ("loop", "output", "error", "ended", "event")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ended = False
        self.event = asyncio.Event()

    def put(self, item: RequestOutput | BaseException | None) -> None:
        if isinstance(item, RequestOutput):
            self.output = item
        elif item is None:
            self.ended = True
        else:
            self.error = item
        self.event.set()


def _deliver(items: list[tuple[_Stream, RequestOutput | BaseException | None]]) -> None:
    for stream, item in items:
        stream.put(item)


class AsyncEngine:
    """Wraps an `LLMEngine`; `generate()` streams a request's cumulative outputs."""

    def __init__(self, engine: Any, stall_timeout_s: float = 300.0) -> None:
        """`stall_timeout_s`: a step running longer than this makes the engine unhealthy
        (a hung collective, a wedged device)."""
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self._cond = threading.Condition()
        self._ops: list[_Add | _Abort | _Call] = []
        self._stopping = False
        self._dead: EngineDeadError | None = None
        self._step_started: float | None = None
        self._num_steps = 0
        # Owned by the loop thread only.
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="kvray-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model: str | None = None, **engine_args: Any) -> AsyncEngine:
        from engine.llm_engine import LLMEngine

        engine_args.setdefault("usage_context", "server")
        return cls(LLMEngine.from_engine_args(model=model, **engine_args))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def encode(self, prompt: str) -> list[int]:
        """Prompt text -> token ids, exactly as the engine tokenizes a text prompt."""
        return self.engine.encode(prompt)

    @property
    def max_model_len(self) -> int:
        return self.engine.config.scheduler_config.max_model_len

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @property
    def is_healthy(self) -> bool:
        """True while the loop thread is alive and no step has raised or hung."""
        if self._dead is not None or not self._thread.is_alive():
            return False
        started = self._step_started
        return started is None or time.monotonic() - started < self.stall_timeout_s

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs; the last one has `finished=True`.

        Bad input raises the engine's ValueError from the first iteration. Leaving the
        loop early (break, cancellation, an exception) aborts the request and frees its KV
        blocks. A request aborted with `abort()` just ends.
        """
        if self._dead is not None:
            raise self._dead
        stream = _Stream(asyncio.get_running_loop())
        self._submit(_Add(request_id, prompt, sampling_params, priority, cache_salt, stream))
        finished = False
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    finished = True
                    raise stream.error
                output, stream.output = stream.output, None
                if output is not None:
                    finished = output.finished
                    yield output
                    if finished:
                        return
                if stream.ended:
                    finished = True
                    return
        finally:
            if not finished:
                self._submit(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its stream ends and its KV blocks are freed."""
        self._submit(_Abort(request_id))

    async def call(self, fn: Any) -> Any:
        """Run `fn(engine)` on the loop thread between steps and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, future))
        return await asyncio.wrap_future(future)

    async def stats(self) -> dict:
        """The engine's `stats()`, read between steps."""
        return await self.call(lambda engine: engine.stats())

    def shutdown(self, timeout: float | None = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _submit(self, op: _Add | _Abort | _Call) -> None:
        with self._cond:
            dead = self._dead
            if dead is None:
                self._ops.append(op)
                self._cond.notify()
        if dead is not None:
            if isinstance(op, _Add):
                op.stream.loop.call_soon_threadsafe(op.stream.put, dead)
            elif isinstance(op, _Call):
                op.future.set_exception(dead)

    def _run(self) -> None:
        has_work = False
        try:
            while True:
                with self._cond:
                    while not self._ops and not has_work and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        break
                    ops, self._ops = self._ops, []
                self._apply(ops)
                if self.engine.has_unfinished_requests():
                    self._step_started = time.monotonic()
                    outputs = self.engine.step()
                    self._step_started = None
                    self._num_steps += 1
                    self._send_outputs(outputs)
                has_work = self.engine.has_unfinished_requests()
            self._fail_all(EngineDeadError("the engine was shut down"))
        except BaseException as e:
            logger.exception("the engine loop stopped")
            self._fail_all(EngineDeadError(f"the engine loop stopped: {type(e).__name__}: {e}"))

    def _apply(self, ops: list[_Add | _Abort | _Call]) -> None:
        replies: list[tuple[_Stream, RequestOutput | BaseException | None]] = []
        for op in ops:
            if isinstance(op, _Add):
                try:
                    self.engine.add_request(
                        op.request_id,
                        op.prompt,
                        op.sampling_params,
                        priority=op.priority,
                        cache_salt=op.cache_salt,
                    )
                except Exception as e:
                    replies.append((op.stream, e))
                else:
                    self._streams[op.request_id] = op.stream
            elif isinstance(op, _Abort):
                stream = self._streams.pop(op.request_id, None)
                if stream is not None:
                    self.engine.abort_request([op.request_id])
                    replies.append((stream, None))
            else:
                try:
                    op.future.set_result(op.fn(self.engine))
                except Exception as e:
                    op.future.set_exception(e)
        self._reply(replies)

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        replies: list[tuple[_Stream, RequestOutput | BaseException | None]] = []
        for output in outputs:
            if output.finished:
                stream = self._streams.pop(output.request_id, None)
            else:
                stream = self._streams.get(output.request_id)
            if stream is not None:
                replies.append((stream, output))
        self._reply(replies)

    def _reply(self, replies: list[tuple[_Stream, RequestOutput | BaseException | None]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in replies:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass  # that event loop is closed: nobody is left to read these streams

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._cond:
            self._dead = error
            ops, self._ops = self._ops, []
        replies: list[tuple[_Stream, RequestOutput | BaseException | None]] = [
            (stream, error) for stream in self._streams.values()
        ]
        self._streams.clear()
        for op in ops:
            if isinstance(op, _Add):
                replies.append((op.stream, error))
            elif isinstance(op, _Call):
                op.future.set_exception(error)
        self._reply(replies)
