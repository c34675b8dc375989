"""AsyncEngine: the engine loop (a thread, or an engine process), per-request streams,
abort, and failure handling."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.core_process import OutputDecoder, OutputEncoder
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from engine.sampling_params import (
    RequestInputError,
    RequestOutputKind,
    SamplingParams,
    StructuredOutput,
    StructuredOutputError,
)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request):
    eng = AsyncEngine.from_engine_args(
        max_model_len=256, max_num_seqs=8, engine_process=request.param == "process"
    )
    assert eng.in_process == (request.param == "thread")
    yield eng
    eng.shutdown()


async def _collect(eng: AsyncEngine, prompt, request_id: str, params=GREEDY) -> list[RequestOutput]:
    return [out async for out in eng.generate(prompt, params, request_id)]


async def _wait_idle(eng: AsyncEngine, timeout: float = 2.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = await eng.stats()
        if stats["num_running"] + stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def _wait_running(eng: AsyncEngine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (await eng.stats())["num_running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        await asyncio.sleep(0.01)


def test_stream_is_cumulative_and_ends_finished(engine):
    outputs = asyncio.run(_collect(engine, PROMPTS[0], "cumulative"))
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    final = outputs[-1].outputs[0]
    assert len(final.token_ids) == 8 and final.finish_reason == "length"
    for earlier in outputs[:-1]:
        ids = earlier.outputs[0].token_ids
        assert final.token_ids[: len(ids)] == ids


def test_the_first_output_comes_when_the_engine_takes_the_request(engine):
    async def run():
        taken = [out async for out in engine.generate(PROMPTS[1], GREEDY, "taken")]
        final_only = SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        return taken, [out async for out in engine.generate(PROMPTS[1], final_only, "final")]

    taken, final_only = asyncio.run(run())
    first = taken[0]
    assert not first.finished and first.outputs[0].token_ids == [] and first.outputs[0].text == ""
    assert first.prompt_token_ids == engine.encode(PROMPTS[1])
    assert all(out.outputs[0].token_ids for out in taken[1:])
    # Asked for the final output only: that is the only one.
    assert len(final_only) == 1 and final_only[0].finished
    assert final_only[0].outputs[0].token_ids == taken[-1].outputs[0].token_ids


def test_concurrent_requests_match_one_at_a_time(engine):
    async def run():
        alone = [await _collect(engine, p, f"alone-{i}") for i, p in enumerate(PROMPTS)]
        together = await asyncio.gather(
            *(_collect(engine, p, f"together-{i}") for i, p in enumerate(PROMPTS))
        )
        return alone, together

    alone, together = asyncio.run(run())
    for a, t in zip(alone, together, strict=True):
        assert t[-1].outputs[0].token_ids == a[-1].outputs[0].token_ids
        assert t[-1].outputs[0].text == a[-1].outputs[0].text


def test_leaving_the_stream_aborts_and_frees_kv(engine):
    async def run():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        async for out in engine.generate(PROMPTS[1], params, "leaver"):
            if len(out.outputs[0].token_ids) >= 2:
                break
        return await _wait_idle(engine)

    stats = asyncio.run(run())
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_cache_usage"] == 0


def test_cancelled_consumer_aborts_the_request(engine):
    async def run():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        task = asyncio.ensure_future(_collect(engine, PROMPTS[2], "cancelled", params))
        await _wait_running(engine)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _wait_idle(engine)

    stats = asyncio.run(run())
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0


def test_abort_ends_the_stream(engine):
    async def run():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        seen = []
        async for out in engine.generate(PROMPTS[3], params, "aborted"):
            seen.append(out)
            if len(seen) == 2:
                engine.abort("aborted")
        return seen, await _wait_idle(engine)

    seen, stats = asyncio.run(run())
    assert len(seen[-1].outputs[0].token_ids) < 200
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0


def test_bad_input_raises_from_generate_and_the_loop_keeps_serving(engine):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(engine, list(range(300)), "too-long")
        with pytest.raises(ValueError, match="empty"):
            await _collect(engine, [], "empty")
        return await _collect(engine, PROMPTS[0], "after-errors")

    outputs = asyncio.run(run())
    assert outputs[-1].finished
    assert engine.is_healthy


def test_structured_requests_are_checked_and_served_after_their_grammar_compiles(engine):
    async def run():
        bad_schema = StructuredOutput('{"type": "objectx"}')
        with pytest.raises(StructuredOutputError, match="structured_output"):
            await _collect(
                engine, PROMPTS[0], "bad-schema", SamplingParams(structured_output=bad_schema)
            )
        any_object = SamplingParams(
            temperature=0, max_tokens=6, structured_output=StructuredOutput()
        )
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(engine, list(range(300)), "too-long-json", any_object)
        return await _collect(engine, PROMPTS[0], "json", any_object)

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].text.startswith("{")
    assert engine.is_healthy


def test_idle_loop_does_not_step(engine):
    before = engine.num_steps
    time.sleep(0.3)
    assert engine.num_steps == before
    assert engine.is_healthy


class _FailingEngine:
    """Honours the LLMEngine API; step() raises on its third call."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.steps = 0

    def add_request(self, request_id, prompt, sampling_params, **kwargs):
        self.requests[request_id] = 0
        return RequestOutput(request_id, None, [1], [CompletionOutput(0, "", [])], finished=False)

    def abort_request(self, request_ids) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def take_failed(self) -> list:
        return []

    def has_admitted_work(self) -> bool:
        return bool(self.requests)

    def batch_wait_left(self) -> float:
        return 0.0

    def step(self, admit_new: bool = True) -> list[RequestOutput]:
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("device lost")
        return [
            RequestOutput(rid, None, [1], [CompletionOutput(0, "x", [7])], finished=False)
            for rid in self.requests
        ]


def test_step_failure_fails_in_flight_requests_and_health():
    eng = AsyncEngine(_FailingEngine())

    async def run():
        with pytest.raises(EngineDeadError, match="device lost"):
            await _collect(eng, [1, 2], "in-flight")
        with pytest.raises(EngineDeadError):
            await _collect(eng, [1, 2], "after-death")

    asyncio.run(asyncio.wait_for(run(), timeout=5))
    assert not eng.is_healthy


def test_n_samples_logprobs_and_stop_strings_come_through_whole(engine):
    params = SamplingParams(
        temperature=0.8, seed=3, n=2, max_tokens=12, logprobs=2, stop=[" the"], ignore_eos=True
    )
    outputs = asyncio.run(_collect(engine, PROMPTS[2], "n-two", params))
    final = outputs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    for c in final.outputs:
        assert len(c.logprobs) == len(c.token_ids) > 0
        assert " the" not in c.text
        assert c.text == engine.tokenizer.decode(c.token_ids)[: len(c.text)]


def test_engine_process_death_fails_requests_and_health():
    eng = AsyncEngine.from_engine_args(max_model_len=256, max_num_seqs=8, engine_process=True)

    async def run():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        with pytest.raises(EngineDeadError, match="exited"):
            async for _ in eng.generate(PROMPTS[0], params, "doomed"):
                eng._core._process.kill()
        with pytest.raises(EngineDeadError):
            await _collect(eng, PROMPTS[1], "after-death")

    try:
        asyncio.run(asyncio.wait_for(run(), timeout=30))
        assert not eng.is_healthy
    finally:
        eng.shutdown()


def test_output_deltas_rebuild_the_cumulative_outputs():
    """What crosses from the engine process: deltas, also where a stop string cut the text."""

    def out(text, ids, finished=False, lp=True):
        logprobs = [TokenLogprobs(t, -0.5, 1, {t: -0.5}) for t in ids] if lp else None
        completion = CompletionOutput(0, text, ids, "stop" if finished else None, logprobs=logprobs)
        return RequestOutput("r", "p", [1, 2], [completion], finished, num_cached_tokens=1)

    steps = [out("He", [5]), out("Hello", [5, 6]), out("Hello wo", [5, 6, 7])]
    steps.append(out("Hello", [5, 6, 7], finished=True))  # the stop string " wo" cut off
    encoder, decoder = OutputEncoder(), OutputDecoder()
    for expected in steps:
        (got,) = decoder.decode(encoder.encode([expected]))
        assert got == expected
    assert encoder._sent == {} and decoder._last == {}

    # Prompt ids the parent sent do not cross back; the parent's own copy fills them in.
    sent = {"r": [1, 2]}
    encoder, decoder = OutputEncoder(), OutputDecoder(sent)
    encoder.sent_as_ids("r")
    first = encoder.encode([steps[0]])
    assert first[0][3] == ("p", None)
    assert decoder.decode(first) == [steps[0]] and sent == {}
    for expected in steps[1:]:
        (got,) = decoder.decode(encoder.encode([expected]))
        assert got == expected


def test_prompt_logprobs_cross_once_and_stay_on_later_outputs():
    prompt_logprobs = [None, TokenLogprobs(2, -1.5, 3, {9: -0.2})]

    def out(ids, with_prompt_logprobs):
        completion = CompletionOutput(0, "x" * len(ids), ids)
        return RequestOutput(
            "r", "p", [1, 2], [completion], finished=len(ids) == 3,
            prompt_logprobs=prompt_logprobs if with_prompt_logprobs else None,
        )  # fmt: skip

    steps = [out([], False), out([5], True), out([5, 6], True), out([5, 6, 7], True)]
    encoder, decoder = OutputEncoder(), OutputDecoder()
    crossed = []
    for expected in steps:
        deltas = encoder.encode([expected])
        crossed.append(deltas[0][5])
        (got,) = decoder.decode(deltas)
        assert got == expected
    assert crossed == [None, prompt_logprobs, None, None]


@pytest.mark.parametrize(
    ("device", "omp", "expected"),
    [("cuda", None, 1), ("cpu", None, 3), ("cuda", "2", 3)],
)
def test_a_gpu_engine_process_runs_one_cpu_thread_unless_told(device, omp, expected):
    """A GPU engine's CPU work is launches between kernels; a torch thread pool only slows
    them. A CPU engine keeps its threads, and OMP_NUM_THREADS, when set, wins."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    code = (
        "import torch\n"
        "from engine.config import EngineArgs\n"
        "from engine.core_process import limit_cpu_threads\n"
        "torch.set_num_threads(3)\n"
        f"limit_cpu_threads(EngineArgs(device={device!r}))\n"
        "print(torch.get_num_threads())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert int(result.stdout) == expected


class _SlowSink:
    """A metrics sink that takes 5 ms a call, as a slow exporter would."""

    CALL_S = 0.005

    def __init__(self) -> None:
        self.names: list[str] = []
        self.threads: set[int] = set()

    def _record(self, name: str, value: float, labels: dict) -> None:
        time.sleep(self.CALL_S)
        self.names.append(name)
        self.threads.add(threading.get_ident())

    inc = set = observe = _record


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_an_engine_s_metrics_neither_hold_up_outputs_nor_the_event_loop(
    monkeypatch, engine_process
):
    """A thread-driven engine (a tensor/pipeline-parallel group) and an engine process
    alike: the engine loop buffers its metrics, the event loop records them."""
    import engine.observability.metrics_replay as metrics_replay

    monkeypatch.setattr(metrics_replay, "METRICS_SPREAD_S", 0.05)
    eng = AsyncEngine.from_engine_args(
        max_model_len=256, max_num_seqs=8, engine_process=engine_process
    )
    sink = _SlowSink()

    async def go() -> tuple[bool, int]:
        eng.enable_metrics(sink)
        await eng.stats()  # the engine loop has switched its metrics on
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        async for _ in eng.generate(PROMPTS[0], params, "metered"):
            pass
        # The request's end comes with the metrics flushed at it (its latency among them),
        # each 5 ms to record here.
        recorded_first = "kvray_e2e_request_latency_seconds" in sink.names
        ticks, deadline = 0, time.monotonic() + 10
        while "kvray_e2e_request_latency_seconds" not in sink.names:
            assert time.monotonic() < deadline, sink.names
            await asyncio.sleep(0.001)
            ticks += 1
        return recorded_first, ticks

    try:
        recorded_first, ticks = asyncio.run(go())
    finally:
        eng.shutdown()
    assert "kvray_time_to_first_token_seconds" in sink.names
    assert sink.names.count("kvray_inter_token_latency_seconds") == 7
    # The last output did not wait for the metrics that came with it...
    assert not recorded_first
    # ...nor did the event loop: it went on turning between them...
    assert ticks >= 3
    # ...which recorded every one of them.
    assert sink.threads == {threading.main_thread().ident}


def test_a_batch_of_metric_events_is_recorded_a_few_at_a_time(monkeypatch):
    """An idle engine's flush (a whole request's events at once) is spread over the ticks
    of METRICS_SPREAD_S, in order, so the next request does not wait for all of it."""
    import engine.observability.metrics_replay as metrics_replay

    monkeypatch.setattr(metrics_replay, "METRICS_SPREAD_S", 1.0)
    monkeypatch.setattr(metrics_replay, "METRICS_TICK_S", 0.1)  # 10 ticks a batch

    class Sink:
        def __init__(self) -> None:
            self.values: list[float] = []

        def observe(self, name: str, value: float, labels: dict) -> None:
            self.values.append(value)

    async def go() -> list[int]:
        sink = Sink()
        recorder = metrics_replay.SpreadRecorder(asyncio.get_running_loop(), sink)
        recorder.add([("observe", "m", float(i), {}) for i in range(45)])
        assert sink.values == []  # nothing at once
        counts = []
        while recorder._timer is not None:
            recorder._timer.cancel()
            recorder._tick()
            counts.append(len(sink.values))
        assert sink.values == [float(i) for i in range(45)]
        return counts

    assert asyncio.run(go()) == [5, 10, 15, 20, 25, 30, 35, 40, 45]


def test_an_id_that_is_another_requests_sample_is_refused_and_the_loop_keeps_serving(engine):
    # n > 1 runs samples `id#0`, `id#1`: a request named so once overwrote the sample's
    # owner and the engine loop then died on the next step, failing every request.
    two = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)

    async def run():
        running = asyncio.ensure_future(_collect(engine, PROMPTS[0], "x", two))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="'x#0' is already in use"):
            await _collect(engine, PROMPTS[1], "x#0")
        first = await running
        lone = asyncio.ensure_future(_collect(engine, PROMPTS[1], "y#1", GREEDY))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="already in use"):
            await _collect(engine, PROMPTS[0], "y", two)
        return first, await lone

    first, lone = asyncio.run(run())
    assert first[-1].finished and len(first[-1].outputs) == 2 and lone[-1].finished
    assert engine.is_healthy and engine.num_requests == 0


@pytest.mark.parametrize(
    ("prompt", "words"),
    [(None, "got NoneType"), (5, "got int"), ([1.5, 2.0], "got float 1.5"),
     ([1, True], "got bool True"), (["a"], "got str 'a'"), ([[1]], "got list [1]")],
)  # fmt: skip
def test_a_prompt_that_is_neither_text_nor_ids_is_a_value_error_naming_it(engine, prompt, words):
    with pytest.raises(RequestInputError, match="prompt must be text or token ids") as info:
        asyncio.run(_collect(engine, prompt, f"bad-{words}"))
    assert words in str(info.value) and info.value.field == "prompt"
    with pytest.raises(ValueError, match="request_id must be a string"):
        asyncio.run(_collect(engine, [1, 2], None))
    assert engine.num_requests == 0  # the process engine once kept the stream of None
    ids = asyncio.run(_collect(engine, list(np.arange(3, 9)), f"numpy-{words}"))
    assert ids[-1].prompt_token_ids == list(range(3, 9)) and ids[-1].finished


def test_a_truncated_prompt_comes_back_as_the_engine_kept_it(engine):
    keep = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=4, prompt_logprobs=0)
    final = asyncio.run(_collect(engine, list(range(10, 20)), "truncated", keep))[-1]
    assert final.prompt_token_ids == [16, 17, 18, 19]
    assert len(final.prompt_logprobs) == 4


def test_the_largest_seed_with_several_samples_is_served(engine):
    params = SamplingParams(temperature=1.0, seed=2**64 - 1, n=2, max_tokens=4)
    final = asyncio.run(_collect(engine, PROMPTS[2], "big-seed", params))[-1]
    assert final.finished and all(len(o.token_ids) == 4 for o in final.outputs)
