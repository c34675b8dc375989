"""What runs next to an `LLMEngine` when callers sit on another thread or process.

Callers queue operations (add a request, abort one, call an engine method); `CoreLoop`
applies them between steps and collects what the caller must hear: outputs, the requests
that failed to add or were aborted, and call results. `AsyncEngine` drives it from a
thread of its own process, or from the engine process (engine/core_process.py).

A request with a structured output waits outside the engine while its grammar compiles on
the engine's compile thread (seconds for some schemas), and is added once it is ready, so
the requests already running never wait for a compile.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class AddOp:
    request_id: str
    prompt: str | list[int]
    sampling_params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float | None = None


@dataclass
class AbortOp:
    request_id: str


@dataclass
class CallOp:
    """`getattr(engine, method)(*args, **kwargs)` between steps; the result goes back by `call_id`."""

    call_id: int
    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


Op = AddOp | AbortOp | CallOp


@dataclass
class Results:
    """What one round of the loop produced for its callers."""

    outputs: list[RequestOutput] = field(default_factory=list)
    """Outputs of the requests added this round (no tokens yet) and of the step run."""
    failed: list[tuple[str, BaseException]] = field(default_factory=list)
    """Requests the engine refused, or a step failed on alone (request id, the error)."""
    ended: list[str] = field(default_factory=list)
    """Requests aborted by an AbortOp: their streams just end."""
    calls: list[tuple[int, Any, BaseException | None]] = field(default_factory=list)
    num_steps: int = 0
    """Steps run since the loop started."""

    def __bool__(self) -> bool:
        return bool(self.outputs or self.failed or self.ended or self.calls)


# With nothing to step but grammars compiling, how long `step` waits for one of them.
COMPILE_POLL_S = 0.005


class CoreLoop:
    """Applies operations to an engine and steps it; knows nothing of threads or loops."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.num_steps = 0
        self._live: set[str] = set()
        self._compiling: dict[str, tuple[Future, AddOp]] = {}
        """Structured requests whose grammar is compiling, in arrival order."""

    def apply(self, ops: list[Op]) -> Results:
        results = Results(num_steps=self.num_steps)
        for op in ops:
            if isinstance(op, AddOp):
                spec = op.sampling_params.structured_output
                if spec is None:
                    self._add(op, results)
                else:
                    if op.arrival_time is None:  # the compile counts as time in the queue
                        op = dataclasses.replace(op, arrival_time=time.monotonic())
                    self._compiling[op.request_id] = (self.engine.compile_grammar(spec), op)
            elif isinstance(op, AbortOp):
                if op.request_id in self._compiling:
                    self._compiling.pop(op.request_id)[0].cancel()
                    results.ended.append(op.request_id)
                elif op.request_id in self._live:
                    self._live.discard(op.request_id)
                    self.engine.abort_request([op.request_id])
                    results.ended.append(op.request_id)
            else:
                try:
                    result = getattr(self.engine, op.method)(*op.args, **op.kwargs)
                except Exception as e:
                    results.calls.append((op.call_id, None, e))
                else:
                    results.calls.append((op.call_id, result, None))
        return results

    def has_work(self) -> bool:
        return bool(self._compiling) or self.engine.has_unfinished_requests()

    def arrival_wait_s(self) -> float:
        """How long the caller may wait for more arrivals (new ops) before `step`: new
        requests are held back for a batch (batch_wait_timeout_ms) and nothing else runs.
        0: step now. The caller wakes at once for an op, which may fill the batch."""
        if self._compiling or self.engine.has_admitted_work():
            return 0.0
        return self.engine.batch_wait_left()

    def step(self) -> Results:
        """Add the structured requests whose grammar is ready, then step the engine (with
        only compiles pending, wait for one a moment instead). While new requests are held
        back for a batch (`arrival_wait_s`), the running ones step without them."""
        results = Results()
        self._add_compiled(results)
        if not self.engine.has_unfinished_requests() and self._compiling:
            futures = [future for future, _ in self._compiling.values()]
            wait(futures, timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)
            self._add_compiled(results)
        if self.engine.has_unfinished_requests():
            results.outputs += self.engine.step(admit_new=self.engine.batch_wait_left() <= 0)
            self.num_steps += 1
            for request_id, error in self.engine.take_failed():
                self._live.discard(request_id)
                results.failed.append((request_id, error))
        for output in results.outputs:
            if output.finished:
                self._live.discard(output.request_id)
        results.num_steps = self.num_steps
        return results

    def _add(self, op: AddOp, results: Results, grammar: Any = None) -> None:
        try:
            taken = self.engine.add_request(
                op.request_id,
                op.prompt,
                op.sampling_params,
                priority=op.priority,
                cache_salt=op.cache_salt,
                arrival_time=op.arrival_time,
                grammar=grammar,
            )
        except Exception as e:
            results.failed.append((op.request_id, e))
        else:
            self._live.add(op.request_id)
            # A streamed request's first output says the engine took it (no tokens yet):
            # its response can start while the prompt is computed, and every error left
            # after this point is one a stream reports in its body.
            if op.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
                results.outputs.append(taken)

    def _add_compiled(self, results: Results) -> None:
        """Add the structured requests whose grammar is ready (or fail them)."""
        for request_id, (future, op) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                grammar = future.result()
            except Exception as e:
                results.failed.append((request_id, e))
            else:
                self._add(op, results, grammar)
