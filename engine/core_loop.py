"""What runs next to an `LLMEngine` when callers sit on another thread or process.

Callers queue operations (add a request, abort one, call an engine method); `CoreLoop`
applies them between steps and collects what the caller must hear: outputs, the requests
that failed to add or were aborted, and call results. `AsyncEngine` drives it from a
thread of its own process, or from the engine process (engine/core_process.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


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
    """`getattr(engine, method)(*args)` between steps; the result goes back by `call_id`."""

    call_id: int
    method: str
    args: tuple = ()


Op = AddOp | AbortOp | CallOp


@dataclass
class Results:
    """What one round of the loop produced for its callers."""

    outputs: list[RequestOutput] = field(default_factory=list)
    failed: list[tuple[str, BaseException]] = field(default_factory=list)
    """Requests the engine refused (request id, the engine's exception)."""
    ended: list[str] = field(default_factory=list)
    """Requests aborted by an AbortOp: their streams just end."""
    calls: list[tuple[int, Any, BaseException | None]] = field(default_factory=list)
    num_steps: int = 0
    """Steps run since the loop started."""

    def __bool__(self) -> bool:
        return bool(self.outputs or self.failed or self.ended or self.calls)


class CoreLoop:
    """Applies operations to an engine and steps it; knows nothing of threads or loops."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.num_steps = 0
        self._live: set[str] = set()

    def apply(self, ops: list[Op]) -> Results:
        results = Results(num_steps=self.num_steps)
        for op in ops:
            if isinstance(op, AddOp):
                try:
                    self.engine.add_request(
                        op.request_id,
                        op.prompt,
                        op.sampling_params,
                        priority=op.priority,
                        cache_salt=op.cache_salt,
                        arrival_time=op.arrival_time,
                    )
                except Exception as e:
                    results.failed.append((op.request_id, e))
                else:
                    self._live.add(op.request_id)
            elif isinstance(op, AbortOp):
                if op.request_id in self._live:
                    self._live.discard(op.request_id)
                    self.engine.abort_request([op.request_id])
                    results.ended.append(op.request_id)
            else:
                try:
                    result = getattr(self.engine, op.method)(*op.args)
                except Exception as e:
                    results.calls.append((op.call_id, None, e))
                else:
                    results.calls.append((op.call_id, result, None))
        return results

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> Results:
        outputs = self.engine.step()
        self.num_steps += 1
        for output in outputs:
            if output.finished:
                self._live.discard(output.request_id)
        return Results(outputs=outputs, num_steps=self.num_steps)
