"""Dynamic batching (batch_wait_timeout_ms) in the engine loop: arrivals within the window
start in one step, a full batch starts at once, one request alone waits the timeout and no
longer, and with the timeout off each arrival starts when it comes. A tiny model with dummy
weights; the hold rule itself is tested on a fake clock in tests/unit/test_batch_wait.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams

TIMEOUT_MS = 1500
MAX_NUM_SEQS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _engine(timeout_ms: float) -> AsyncEngine:
    return AsyncEngine.from_engine_args(
        model="tiny-llama",
        load_format="dummy",
        max_model_len=128,
        max_num_seqs=MAX_NUM_SEQS,
        batch_wait_timeout_ms=timeout_ms,
        engine_process=False,
    )


@pytest.fixture(scope="module")
def held():
    # The engine loop on a thread; an engine process waits the same way (core_process.py)
    # but takes far longer to start than these tests run.
    eng = _engine(TIMEOUT_MS)
    # A first forward is slow (allocations): out of the timed tests, as a full batch, which
    # starts at once.
    asyncio.run(_arrivals(eng, "warm", MAX_NUM_SEQS, 0.0))
    yield eng
    eng.shutdown()


async def _first_token_s(eng: AsyncEngine, request_id: str, delay: float) -> float:
    """Seconds from this request's submission to its first token (it runs to its end)."""
    await asyncio.sleep(delay)
    start, first = time.monotonic(), None
    async for out in eng.generate([7, 8, 9, 10], PARAMS, request_id):
        if first is None and out.outputs[0].token_ids:
            first = time.monotonic() - start
    assert first is not None
    return first


async def _arrivals(eng: AsyncEngine, tag: str, n: int, gap_s: float) -> list[float]:
    tasks = [_first_token_s(eng, f"{tag}-{i}", i * gap_s) for i in range(n)]
    return list(await asyncio.gather(*tasks))


async def _admitting_steps(eng: AsyncEngine) -> int:
    return await eng.call("admission_steps")


def test_arrivals_within_the_window_start_in_one_step_when_the_batch_fills(held):
    async def run() -> tuple[int, list[float]]:
        before = await _admitting_steps(held)
        ttfts = await _arrivals(held, "fill", MAX_NUM_SEQS, 0.03)
        return await _admitting_steps(held) - before, ttfts

    steps, ttfts = asyncio.run(run())
    assert steps == 1
    # The fourth arrival fills the batch: the step starts then, not at the timeout.
    assert ttfts[0] < TIMEOUT_MS / 1000 * 0.6


def test_one_request_alone_waits_the_timeout_and_no_longer(held):
    async def run() -> tuple[int, list[float]]:
        before = await _admitting_steps(held)
        ttfts = await _arrivals(held, "alone", 1, 0.0)
        return await _admitting_steps(held) - before, ttfts

    steps, [ttft] = asyncio.run(run())
    assert steps == 1
    timeout_s = TIMEOUT_MS / 1000
    assert timeout_s * 0.95 <= ttft < timeout_s + 1.0


def test_with_the_timeout_off_each_arrival_starts_when_it_comes():
    eng = _engine(0)
    try:

        async def run() -> tuple[int, list[float]]:
            await _arrivals(eng, "warm", MAX_NUM_SEQS, 0.0)  # the slow first forward
            before = await _admitting_steps(eng)
            ttfts = await _arrivals(eng, "off", MAX_NUM_SEQS, 0.1)
            return await _admitting_steps(eng) - before, ttfts

        steps, ttfts = asyncio.run(run())
    finally:
        eng.shutdown()
    # Each comes while the ones before it decode: a step of its own, unless the loop was
    # slower than the gap between two arrivals.
    assert steps > 1
    assert max(ttfts) < TIMEOUT_MS / 1000 * 0.6


def test_a_step_that_admits_no_one_launches_nothing_once_the_running_requests_are_done():
    from engine import LLM

    engine = LLM(model="tiny-llama", load_format="dummy", max_model_len=128).engine
    launched = []
    execute = engine.executor.execute_model_async
    engine.executor.execute_model_async = lambda out: launched.append(out) or execute(out)
    engine.add_request("running", [7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.add_request("held", [7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    finished = False
    for _ in range(10):  # "running" decodes to its end while "held" is held back
        finished |= any(o.finished for o in engine.step(admit_new=False))
    assert finished and not engine.has_admitted_work()
    assert all("held" not in out.num_scheduled_tokens for out in launched)
    assert all(not out.is_empty for out in launched)  # nothing launched to wait
    num_launched = len(launched)
    engine.step(admit_new=False)
    assert len(launched) == num_launched
    engine.step()
    assert "held" in launched[-1].num_scheduled_tokens
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="batch_wait_timeout_ms"):
            engine.set_batch_wait_timeout_ms(bad)
    engine.set_batch_wait_timeout_ms(20)
    assert engine.scheduler.batch_wait_timeout_s == 0.02
