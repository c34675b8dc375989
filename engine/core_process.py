"""The engine in a process of its own, driven over a pipe.

Why: torch releases the GIL around every op, so an engine thread that shares a process
with a busy event loop (hundreds of streams being formatted and sent) waits for the GIL
after each of the dozens of ops in a step, and under load its steps run several times
slower than offline (bench/RESULTS.md). In its own process the engine steps at full speed
and the caller's loop only turns results into responses.

Protocol. Parent -> child: core_loop ops, or None to stop. Child -> parent: ("ready",
info) once, then ("results", ...) after every round that produced something and after
every step, or ("dead", message). Outputs cross as deltas (`OutputEncoder` and
`OutputDecoder`): a request's
cumulative output would cost a copy of every token so far on every step.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from os.path import commonprefix
from typing import Any

from engine.config import EngineArgs, UsageContext
from engine.core_loop import AddOp, CoreLoop, Op, Results
from engine.observability import hop_trace
from engine.observability.gc_pauses import freeze_startup_heap
from engine.observability.metrics import BufferedSink
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import truncate_prompt

# A delta of one request: (request_id, finished, num_cached_tokens, (prompt, prompt ids) on
# its first delta else None, completion deltas, prompt logprobs on the first delta that has
# them else None). A completion delta: (index, text length kept, new text, new token ids,
# new logprobs or None, finish_reason, stop_reason, cumulative_logprob).
_RequestDelta = tuple


class OutputEncoder:
    """Child side: cumulative `RequestOutput`s -> deltas against what was sent before.

    A request's first delta carries its prompt's token ids unless the parent sent them
    (`sent_as_ids`): a burst of 500 prompts of 1,024 tokens would otherwise cross back as
    half a million ints in the one message that precedes the first step.
    """

    def __init__(self) -> None:
        self._sent: dict[str, list[tuple[int, str, int]]] = {}
        self._parent_has_ids: set[str] = set()
        self._sent_prompt_logprobs: set[str] = set()

    def sent_as_ids(self, request_id: str) -> None:
        """The parent gave this request's prompt as token ids: do not send them back."""
        self._parent_has_ids.add(request_id)

    def encode(self, outputs: list[RequestOutput]) -> list[_RequestDelta]:
        deltas = []
        for out in outputs:
            sent = self._sent.get(out.request_id)
            prompt = None
            if sent is None:
                sent = []
                known = out.request_id in self._parent_has_ids
                self._parent_has_ids.discard(out.request_id)
                prompt = (out.prompt, None if known else out.prompt_token_ids)
            completions = []
            for i, c in enumerate(out.outputs):
                n_ids, text, n_logprobs = sent[i] if i < len(sent) else (0, "", 0)
                keep = len(text) if c.text.startswith(text) else len(commonprefix([text, c.text]))
                n_ids = min(n_ids, len(c.token_ids))
                new_logprobs = None
                if c.logprobs is not None:
                    n_logprobs = min(n_logprobs, len(c.logprobs))
                    new_logprobs = c.logprobs[n_logprobs:]
                completions.append(
                    (
                        c.index,
                        keep,
                        c.text[keep:],
                        c.token_ids[n_ids:],
                        new_logprobs,
                        c.finish_reason,
                        c.stop_reason,
                        c.cumulative_logprob,
                    )
                )
                state = (len(c.token_ids), c.text, len(c.logprobs or ()))
                if i < len(sent):
                    sent[i] = state
                else:
                    sent.append(state)
            prompt_logprobs = None
            if out.prompt_logprobs is not None and out.request_id not in self._sent_prompt_logprobs:
                prompt_logprobs = out.prompt_logprobs
                self._sent_prompt_logprobs.add(out.request_id)
            if out.finished:
                self._sent.pop(out.request_id, None)
                self._sent_prompt_logprobs.discard(out.request_id)
            else:
                self._sent[out.request_id] = sent
            deltas.append(
                (
                    out.request_id,
                    out.finished,
                    out.num_cached_tokens,
                    prompt,
                    completions,
                    prompt_logprobs,
                )
            )
        return deltas

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._sent.pop(request_id, None)
            self._parent_has_ids.discard(request_id)
            self._sent_prompt_logprobs.discard(request_id)


class OutputDecoder:
    """Parent side: deltas -> fresh cumulative `RequestOutput`s (callers may keep old ones).

    `prompt_ids`: the prompts the parent sent as token ids, by request id (the parent adds
    to it as it sends); a first delta without ids takes them from there.
    """

    def __init__(self, prompt_ids: dict[str, list[int]] | None = None) -> None:
        self._last: dict[str, RequestOutput] = {}
        self._prompt_ids = {} if prompt_ids is None else prompt_ids

    def decode(self, deltas: list[_RequestDelta]) -> list[RequestOutput]:
        outputs = []
        for request_id, finished, num_cached, prompt, completions, prompt_logprobs in deltas:
            last = self._last.get(request_id)
            if prompt is not None or last is None:
                text, ids = prompt if prompt is not None else (None, None)
                if ids is None:
                    ids = self._prompt_ids.pop(request_id, [])
                last = RequestOutput(request_id, text, ids, [], finished=False)
            previous = {c.index: c for c in last.outputs}
            merged = []
            for index, keep, text, ids, logprobs, finish_reason, stop_reason, cum in completions:
                old = previous.get(index) or CompletionOutput(index, "", [], logprobs=None)
                merged.append(
                    CompletionOutput(
                        index=index,
                        text=old.text[:keep] + text,
                        token_ids=old.token_ids + ids,
                        finish_reason=finish_reason,
                        stop_reason=stop_reason,
                        logprobs=None if logprobs is None else (old.logprobs or []) + logprobs,
                        cumulative_logprob=cum,
                    )
                )
            out = RequestOutput(
                request_id,
                last.prompt,
                last.prompt_token_ids,
                merged,
                finished=finished,
                num_cached_tokens=num_cached,
                prompt_logprobs=last.prompt_logprobs
                if prompt_logprobs is None
                else prompt_logprobs,
            )
            if finished:
                self._last.pop(request_id, None)
            else:
                self._last[request_id] = out
            outputs.append(out)
        return outputs

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._last.pop(request_id, None)
            self._prompt_ids.pop(request_id, None)


class _EngineProcessCalls:
    """Methods the parent may call in the engine process besides the engine's own."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.sink: BufferedSink | None = None

    def enable_metrics(self, flush_interval_s: float = 1.0) -> None:
        self.sink = BufferedSink()
        self.engine.enable_metrics(self.sink, flush_interval_s)

    def serving_info(self) -> dict[str, Any]:
        return serving_info(self.engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def serving_info(engine: Any) -> dict[str, Any]:
    """What the parent reads of the engine without a call: sent once ready, and asked for
    again after the engine has loaded another model (AsyncEngine.refresh_model_info)."""
    return {
        "model_name": engine.model_name,
        "served_model_names": engine.served_model_names,
        "max_model_len": engine.config.scheduler_config.max_model_len,
        "quantization": engine.config.model.quantization,
        "generation_defaults": engine.generation_defaults,
        "tokenizer": engine.tokenizer,
    }


def limit_cpu_threads(engine_args: EngineArgs) -> None:
    """One intra-op CPU thread for a GPU engine, unless OMP_NUM_THREADS says otherwise.

    Its CPU work is small tensor ops between kernel launches; torch's pool of one thread
    per core only adds wake-ups and spinning next to them (bench/RESULTS.md). A replica of Ray Serve already runs with
    OMP_NUM_THREADS=1 (Ray sets it from the replica's CPUs).
    """
    import torch

    if "OMP_NUM_THREADS" not in os.environ and engine_args.resolved_device == "cuda":
        torch.set_num_threads(1)


def run_engine_process(engine_args: EngineArgs, usage_context: UsageContext, conn: Any) -> None:
    """The engine process's main: build the engine, then serve the pipe until told to stop."""
    try:
        from engine.llm_engine import LLMEngine

        limit_cpu_threads(engine_args)

        engine = LLMEngine.from_engine_args(engine_args, usage_context)
    except BaseException as e:
        conn.send(("dead", f"the engine failed to start: {type(e).__name__}: {e}"))
        return
    freeze_startup_heap()
    conn.send(("ready", serving_info(engine)))
    calls = _EngineProcessCalls(engine)
    core = CoreLoop(calls)
    encoder = OutputEncoder()

    def send(results: Results) -> None:
        events = calls.sink.drain() if calls.sink is not None else []
        encoder.forget(results.ended + [rid for rid, _ in results.failed])
        calls_out = [(i, r, _picklable(e)) for i, r, e in results.calls]
        failed = [(rid, _picklable(e)) for rid, e in results.failed]
        payload = (encoder.encode(results.outputs), failed, results.ended, calls_out)
        if hop_trace.enabled():  # before the send: the parent may act on it at once
            tokens = any(o.outputs and o.outputs[0].token_ids for o in results.outputs)
            hop_trace.hop("engine_sent_tokens" if tokens else "engine_sent")
        conn.send(("results", payload, results.num_steps, events))

    try:
        arrival_wait = 0.0
        while True:
            ops: list[Op] = []
            if not core.has_work():
                ops.append(conn.recv())
            elif arrival_wait > 0:
                conn.poll(arrival_wait)  # a batch waits for more arrivals (batch_wait_left)
            while conn.poll():
                ops.append(conn.recv())
            if None in ops:
                break
            for op in ops:
                if isinstance(op, AddOp) and not isinstance(op.prompt, str):
                    encoder.sent_as_ids(op.request_id)
            if hop_trace.enabled() and any(isinstance(op, AddOp) for op in ops):
                hop_trace.hop("engine_got_add")
            applied = core.apply(ops)
            if applied:
                send(applied)
            arrival_wait = core.arrival_wait_s() if core.has_work() else 0.0
            if core.has_work() and arrival_wait <= 0:
                send(core.step())
    except EOFError:
        pass  # the parent went away
    except BaseException as e:
        try:
            conn.send(("dead", f"the engine loop stopped: {type(e).__name__}: {e}"))
        except Exception:
            pass
    finally:
        try:
            engine.shutdown()
        except Exception:
            pass


def _picklable(e: BaseException | None) -> BaseException | None:
    """The exception itself where it pickles (ValueError, ...), else a RuntimeError."""
    if e is None:
        return None
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


class ProcessCore:
    """Parent side: starts the engine process, sends ops, reads results on a thread."""

    def __init__(
        self,
        engine_args: EngineArgs,
        usage_context: UsageContext,
        deliver: Callable[[Results], None],
        on_dead: Callable[[str], None],
        on_metrics: Callable[[list], None],
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=run_engine_process,
            args=(engine_args, usage_context, child),
            name="kvray-engine",
            daemon=True,
        )
        self._process.start()
        child.close()
        try:
            kind, info = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError(
                f"the engine process exited while starting (code {self._process.exitcode})"
            ) from None
        if kind != "ready":
            self._process.join(5)
            raise RuntimeError(info)
        self.info = info
        self.last_heard = time.monotonic()
        self._deliver, self._on_dead, self._on_metrics = deliver, on_dead, on_metrics
        self._send_lock = threading.Lock()
        self._prompt_ids: dict[str, list[int]] = {}
        """Prompts sent as token ids whose first output has not come back yet."""
        self._reader = threading.Thread(target=self._read, name="kvray-engine-reader", daemon=True)
        self._reader.start()

    def submit(self, op: Op | None) -> bool:
        """False when the engine process can no longer be reached."""
        if isinstance(op, AddOp) and not isinstance(op.prompt, str):
            self._prompt_ids[op.request_id] = self._prompt_as_taken(op)
        if isinstance(op, AddOp):
            hop_trace.hop("submit")
        try:
            with self._send_lock:
                self._conn.send(op)
            return True
        except (OSError, ValueError):
            self._prompt_ids.pop(getattr(op, "request_id", None), None)
            return False

    def _prompt_as_taken(self, op: AddOp) -> list[int]:
        """The ids the engine process will keep of `op`'s prompt (truncate_prompt_tokens)."""
        try:
            keep = op.sampling_params.truncate_prompt_tokens
            return truncate_prompt(list(op.prompt), keep, self.info["max_model_len"])
        except ValueError:
            return list(op.prompt)  # the engine process refuses it and says why

    def is_alive(self) -> bool:
        return self._process.is_alive() and self._reader.is_alive()

    def shutdown(self, timeout: float | None) -> None:
        self.submit(None)
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)

    def _read(self) -> None:
        decoder = OutputDecoder(self._prompt_ids)
        try:
            while True:
                message = self._conn.recv()
                hop_trace.hop("reader_recv")
                self.last_heard = time.monotonic()
                if message[0] == "dead":
                    self._on_dead(message[1])
                    return
                _, (deltas, failed, ended, calls), num_steps, events = message
                decoder.forget(ended + [rid for rid, _ in failed])
                results = Results(decoder.decode(deltas), failed, ended, calls, num_steps)
                self._deliver(results)
                if events:  # after the outputs: a second's metrics under load are thousands
                    self._on_metrics(events)
        except (EOFError, OSError):
            self._process.join(5)
            self._on_dead(f"the engine process exited (code {self._process.exitcode})")
