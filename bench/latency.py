"""Batch decode latency: ms per output token, beside the roofline of the same run.

python -m bench.latency --model-shape llama3-8b --batch-size 1 --input-len 256 --output-len 128

ms/token = (time for output_len tokens - time for 1 token) / (output_len - 1), best of 3 runs
each (the method of the vLLM figures this is compared with). The roofline is the time to read
every weight once at the copy bandwidth measured in this run.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.common import (
    add_engine_args,
    build_llm,
    copy_bandwidth_gbs,
    emit,
    hf_model_for,
    random_prompts,
)
from engine import SamplingParams


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3)
    args = parser.parse_args(argv)

    llm, startup_s = build_llm(args)
    engine = llm.engine
    prompts = random_prompts(args.batch_size, args.input_len, engine.vocab_size, args.seed)

    ms_per_token, ttft_s = measure_latency(llm, prompts, args.output_len, args.num_iters)

    result = {
        "bench": "latency",
        "engine": "kvray",
        "model_shape": args.model_shape or args.model,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "ms_per_token": round(ms_per_token, 3),
        "ttft_s": round(ttft_s, 4),
        "startup_s": round(startup_s, 1),
        "enforce_eager": args.enforce_eager,
        "command": "python -m bench.latency " + " ".join(argv or sys.argv[1:]),
    }
    if engine.config.device == "cuda":
        nbytes = engine.executor.step_weight_bytes()
        bw = copy_bandwidth_gbs()
        result.update(
            weight_gb=round(nbytes / 1e9, 2),
            copy_bandwidth_gbs=round(bw, 0),
            roofline_ms_per_token=round(nbytes / (bw * 1e9) * 1000, 3),
        )
    if args.baseline == "hf":
        engine.shutdown()
        del llm, engine
        torch.cuda.empty_cache()
        result["baseline_ms_per_token"] = round(_hf_ms_per_token(args, prompts), 3)
    emit(result, args.record)
    return result


def measure_latency(llm, prompts: list[list[int]], output_len: int, num_iters: int = 3):
    """(ms per output token, seconds to the first token), best of num_iters each."""

    def timed(max_tokens: int) -> float:
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True
        )
        best = float("inf")
        for _ in range(num_iters):
            start = time.perf_counter()
            llm.generate(prompts, params)
            best = min(best, time.perf_counter() - start)
        return best

    timed(output_len)  # warm-up
    one = timed(1)
    full = timed(output_len)
    return (full - one) / (output_len - 1) * 1000, one


def _hf_ms_per_token(args: argparse.Namespace, prompts: list[list[int]]) -> float:
    model = hf_model_for(args, torch.bfloat16)
    ids = torch.tensor(prompts, device="cuda")

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(4)
    one = min(timed(1) for _ in range(2))
    full = min(timed(args.output_len) for _ in range(2))
    return (full - one) / (args.output_len - 1) * 1000


if __name__ == "__main__":
    main()
