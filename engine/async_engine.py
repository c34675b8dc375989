"""AsyncEngine: the engine core loop off the event loop, with one asyncio stream per request.

`LLMEngine` is synchronous and single-threaded: `add_request`, `abort_request` and `step`
all run on the engine loop (a thread here, or an engine process). Callers on an event
loop queue their requests and aborts; the loop applies them between steps and hands
outputs back with one `loop.call_soon_threadsafe` per step.

Outputs are cumulative, so a stream keeps only the newest one: a consumer slower than the
engine skips intermediate states and loses nothing (its next delta is simply larger).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from engine.config import EngineArgs, UsageContext
from engine.core_loop import AbortOp, AddOp, CallOp, Op, Results
from engine.generation_config import GenerationDefaults
from engine.observability.hop_trace import hop
from engine.observability.metrics import BufferedSink
from engine.observability.metrics_replay import MetricsReplay
from engine.outputs import RequestOutput
from engine.sampling_params import RequestInputError, SamplingParams
from engine.thread_core import ThreadCore
from engine.tokenizer import encode_text


class EngineDeadError(RuntimeError):
    """The core loop has stopped (step() raised, or shutdown); every request fails with it."""


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
    hop("loop_deliver")
    for stream, item in items:
        stream.put(item)


class AsyncEngine:
    """Wraps an `LLMEngine`; `generate()` streams a request's cumulative outputs.

    `AsyncEngine(engine)` steps the engine on a thread of this process;
    `AsyncEngine.from_engine_args(..., engine_process=True)` builds it in a process of its
    own (engine/core_process.py says why), the default for one GPU.
    """

    def __init__(
        self,
        engine: Any | None = None,
        stall_timeout_s: float = 300.0,
        *,
        engine_args: EngineArgs | None = None,
        usage_context: UsageContext = "server",
    ) -> None:
        """`stall_timeout_s`: a step running longer than this makes the engine unhealthy
        (a hung collective, a wedged device). Give `engine` (run on a thread) or
        `engine_args` (built and run in an engine process)."""
        if (engine is None) == (engine_args is None):
            raise ValueError("give exactly one of engine and engine_args")
        self.stall_timeout_s = stall_timeout_s
        self._dead: EngineDeadError | None = None
        self._num_steps = 0
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self._metrics: MetricsReplay | None = None
        if engine is not None:
            self.engine = engine
            self._core: Any = ThreadCore(engine, self._on_results, self._on_dead, self._replay)
            self._tokenizer = engine.tokenizer if hasattr(engine, "tokenizer") else None
        else:
            from engine.core_process import ProcessCore

            self.engine = None
            self._core = ProcessCore(
                engine_args, usage_context, self._on_results, self._on_dead, self._replay
            )
            self._info = self._core.info
            self._tokenizer = self._info["tokenizer"]

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs | None = None,
        engine_process: bool | None = None,
        usage_context: UsageContext = "server",
        **kwargs: Any,
    ) -> AsyncEngine:
        """The engine `engine_args` (or keyword arguments: model=..., max_num_seqs=...)
        describe. `engine_process`: run the engine in a process of its own; by default on one
        GPU (a tensor/pipeline-parallel group is driven from this process)."""
        args = EngineArgs.of(engine_args, kwargs)
        if engine_process is None:
            engine_process = args.world_size == 1 and args.resolved_device == "cuda"
        if engine_process:
            return cls(engine_args=args, usage_context=usage_context)
        from engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(args, usage_context))

    @property
    def in_process(self) -> bool:
        """True when the engine steps on a thread of this process."""
        return self.engine is not None

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name if self.in_process else self._info["model_name"]

    @property
    def served_model_names(self) -> list[str]:
        """Every name requests may give the model (model_name first)."""
        if self.in_process:
            return self.engine.served_model_names
        return self._info["served_model_names"]

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Prompt text -> token ids, exactly as the engine tokenizes a text prompt."""
        if self.in_process:
            return self.engine.encode(prompt, add_special_tokens)
        if self._tokenizer is None:
            raise ValueError("this model has no tokenizer: pass the prompt as token ids")
        return encode_text(self._tokenizer, prompt, add_special_tokens)

    @property
    def max_model_len(self) -> int:
        if self.in_process:
            return self.engine.config.scheduler_config.max_model_len
        return self._info["max_model_len"]

    @property
    def quantization(self) -> str:
        """The quantization method the model runs ("none": 16-bit weights)."""
        if self.in_process:
            return self.engine.config.model.quantization
        return self._info["quantization"]

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The model's generation_config.json defaults (engine/generation_config.py)."""
        if self.in_process:
            return self.engine.generation_defaults
        return self._info["generation_defaults"]

    @property
    def num_requests(self) -> int:
        """Requests whose streams are open (added and not yet finished or aborted)."""
        return len(self._streams)

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @property
    def is_healthy(self) -> bool:
        """True while the engine loop is alive and no step has raised or hung."""
        if self._dead is not None or not self._core.is_alive():
            return False
        if self.in_process:
            started = self._core.step_started
        else:
            # The engine process reports after every step while it has requests.
            started = self._core.last_heard if self._streams else None
        return started is None or time.monotonic() - started < self.stall_timeout_s

    def enable_metrics(self, sink: Any) -> None:
        """Record engine metrics into `sink` (engine/observability/metrics.py) from the next request on.

        The engine loop only buffers them. Called on an event loop, that loop records them,
        a few at a time (engine/observability/metrics_replay.py); else the thread that hands
        the engine's outputs over does, after delivering them."""
        self._metrics = MetricsReplay(sink)
        if self.in_process:
            buffered = BufferedSink()
            self._core.metrics = buffered
            self._submit(CallOp(next(self._call_ids), "enable_metrics", (buffered,)))
        else:
            self._submit(CallOp(next(self._call_ids), "enable_metrics"))

    def check_health(self) -> None:
        """Raise if the engine loop is down or a rank of its executor has died."""
        if not self.is_healthy:
            raise RuntimeError("the engine loop is not running")
        if self.in_process:
            # A rank that died while the engine was idle shows here, not on a request.
            self.engine.executor.check_health()

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs; the last one has `finished=True`.

        Unless `sampling_params` asks for the final output only, the first comes when the
        engine has taken the request, with no tokens yet. Bad input raises the engine's
        ValueError from the first iteration instead. Leaving the
        loop early (break, cancellation, an exception) aborts the request and frees its KV
        blocks. A request aborted with `abort()` just ends.
        """
        if self._dead is not None:
            raise self._dead
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if not isinstance(prompt, str | list | tuple):
            raise RequestInputError(
                "prompt", f"must be text or token ids (ints), got {type(prompt).__name__}"
            )
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop())
        if not self.in_process and not self._streams:
            self._core.last_heard = time.monotonic()  # a busy spell starts: time it from here
        self._streams[request_id] = stream
        arrival = time.monotonic()
        self._submit(AddOp(request_id, prompt, sampling_params, priority, cache_salt, arrival))
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
                self._submit(AbortOp(request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its stream ends and its KV blocks are freed."""
        self._submit(AbortOp(request_id))

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`engine.<method>(*args, **kwargs)` run by the engine loop between steps; its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self._submit(CallOp(call_id, method, args, kwargs))
        return await asyncio.wrap_future(future)

    async def refresh_model_info(self) -> None:
        """Read the model's name, tokenizer and limits again: after a `call` of the engine's
        load_model, which may have changed them."""
        if self.in_process:
            self._tokenizer = self.engine.tokenizer
            return
        self._info = self._core.info = await self.call("serving_info")
        self._tokenizer = self._info["tokenizer"]

    async def stats(self) -> dict:
        """The engine's `stats()`, read between steps."""
        return await self.call("stats")

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self._core.shutdown(timeout)

    def _submit(self, op: Op) -> None:
        if self._dead is None and self._core.submit(op):
            return
        self._fail_op(op, self._dead or EngineDeadError("the engine loop is not running"))

    def _fail_op(self, op: Op, error: EngineDeadError) -> None:
        if isinstance(op, AddOp):
            stream = self._streams.pop(op.request_id, None)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.put, error)
        elif isinstance(op, CallOp):
            future = self._calls.pop(op.call_id, None)
            if future is not None:
                future.set_exception(error)

    # -- on the engine loop's thread (or the engine process's reader thread) --------------

    def _on_results(self, results: Results) -> None:
        self._num_steps = results.num_steps
        replies: list[tuple[_Stream, RequestOutput | BaseException | None]] = []
        for request_id, error in results.failed:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                replies.append((stream, error))
        for request_id in results.ended:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                replies.append((stream, None))
        for output in results.outputs:
            if output.finished:
                stream = self._streams.pop(output.request_id, None)
            else:
                stream = self._streams.get(output.request_id)
            if stream is not None:
                replies.append((stream, output))
        for call_id, result, error in results.calls:
            future = self._calls.pop(call_id, None)
            if future is None:
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        self._reply(replies)

    def _replay(self, events: list) -> None:
        """The engine's metric events into the sink (MetricsReplay says where they are
        recorded)."""
        metrics = self._metrics
        if metrics is not None:
            metrics.replay(events)

    def _reply(self, replies: list[tuple[_Stream, RequestOutput | BaseException | None]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in replies:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass  # that event loop is closed: nobody is left to read these streams

    def _on_dead(self, message: str) -> None:
        error = EngineDeadError(message)
        with self._lock:
            if self._dead is not None:
                return
            self._dead = error
        streams, self._streams = self._streams, {}
        calls, self._calls = self._calls, {}
        for future in calls.values():
            future.set_exception(error)
        self._reply([(stream, error) for stream in streams.values()])
