"""Dynamic batching (batch_wait_timeout_ms) under bursty arrivals: off and at a few timeouts.

python -m bench.batch_wait --model-shape llama3-8b --rate 32 --num-requests 400
python -m bench.batch_wait --quick     # a CPU smoke run: a tiny model with dummy weights

Short random prompts arrive as a Poisson process (--rate requests/s) at an `AsyncEngine`
(in an engine process on one GPU, as a replica runs it); each decodes --output-len tokens,
EOS ignored. One engine serves the same arrivals under each timeout (--timeouts-ms, 0 =
off; `set_batch_wait_timeout_ms` between runs), the timeouts interleaved over --repeats
rounds so that all see the same machine; medians over the rounds: output tokens/s over the
run, mean and p99 time to first token (from submission), mean inter-token latency, the
engine's steps and the steps that admitted new requests (where prompts start: fewer means
prefills batched together).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

from bench.common import add_engine_args, emit, engine_kwargs
from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--quick", action="store_true", help="CPU smoke run, tiny model")
    parser.add_argument("--timeouts-ms", type=float, nargs="+", default=[0, 5, 20, 50])
    parser.add_argument("--rate", type=float, default=32.0, help="Poisson arrivals, requests/s")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the timeouts")
    if "--quick" in (sys.argv[1:] if argv is None else argv):  # defaults; flags still win
        parser.set_defaults(
            model_shape="tiny-llama",
            max_model_len=256,
            num_requests=60,
            input_len=16,
            output_len=8,
            timeouts_ms=[0, 10, 50],
            max_num_seqs=32,
        )
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    gaps = [rng.expovariate(args.rate) for _ in range(args.num_requests)]
    prompts = [
        [rng.randint(100, 999) for _ in range(args.input_len)] for _ in range(args.num_requests)
    ]
    runs: dict[str, list[dict]] = {f"{t:g}ms": [] for t in args.timeouts_ms}
    engine = AsyncEngine.from_engine_args(**engine_kwargs(args))
    try:
        for round_ in range(args.repeats):
            for timeout_ms in args.timeouts_ms:
                figures = asyncio.run(
                    _serve(engine, prompts, gaps, args, timeout_ms, f"{round_}-{timeout_ms:g}")
                )
                runs[f"{timeout_ms:g}ms"].append(figures)
                print(f"round {round_} batch_wait_timeout_ms={timeout_ms:g}: {figures}", flush=True)
    finally:
        engine.shutdown()
    result = {
        "bench": "batch_wait",
        "model": args.model or args.model_shape,
        "rate": args.rate,
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "repeats": args.repeats,
        "results": {name: _medians(figures) for name, figures in runs.items()},
    }
    emit(result, args.record)
    return result


def _medians(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


async def _serve(engine: AsyncEngine, prompts, gaps, args, timeout_ms: float, tag: str) -> dict:
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up outside the clock (first kernel compilations, allocator growth), timeout off.
    await engine.call("set_batch_wait_timeout_ms", 0)
    warm = [_one(engine, p, f"warm-{tag}-{i}", params) for i, p in enumerate(prompts[:4])]
    await asyncio.gather(*warm)
    await engine.call("set_batch_wait_timeout_ms", timeout_ms)
    steps_before, admitting_before = engine.num_steps, await engine.call("admission_steps")

    async def arrive(i: int, at: float) -> tuple[float, float, int]:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        return await _one(engine, prompts[i], f"{tag}-r{i}", params)

    start = time.monotonic()
    arrivals, at = [], start
    for i, gap in enumerate(gaps):
        at += gap
        arrivals.append(arrive(i, at))
    done = await asyncio.gather(*arrivals)
    wall = time.monotonic() - start
    ttfts = sorted(ttft for ttft, _, _ in done)
    itls = [(total - ttft) / (n - 1) for ttft, total, n in done if n > 1]
    return {
        "output_tok_s": round(sum(n for _, _, n in done) / wall, 1),
        "ttft_mean_ms": round(1000 * statistics.fmean(ttfts), 2),
        "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 2),
        "itl_mean_ms": round(1000 * statistics.fmean(itls), 2) if itls else None,
        "steps": engine.num_steps - steps_before,
        "admitting_steps": await engine.call("admission_steps") - admitting_before,
    }


async def _one(engine: AsyncEngine, prompt, request_id: str, params) -> tuple[float, float, int]:
    """(time to first token, time to the last, tokens) of one request, from its submission."""
    start, first, num_tokens = time.monotonic(), None, 0
    async for out in engine.generate(prompt, params, request_id):
        num_tokens = len(out.outputs[0].token_ids)
        if first is None and num_tokens:
            first = time.monotonic() - start
    return first or 0.0, time.monotonic() - start, num_tokens


if __name__ == "__main__":
    main(sys.argv[1:])
