"""KV memory beyond the GPU: preemption by swap against recompute under memory pressure, and
the prefix cache's CPU tier against recomputing a prefix and against a GPU hit.

python -m bench.kv_pressure --record            (llama3-8b shape, dummy weights, one GPU)
python -m bench.kv_pressure --model-shape tiny-llama --num-prompts 8 --input-len 48 \\
    --output-len 16 --prefix-len 64 --suffix-len 8 --max-model-len 256 --swap-space 0.05
                                                (a tiny run that works on a CPU)

pressure: --num-prompts prompts of --input-len random tokens, --output-len greedy tokens
each (EOS ignored), all submitted at once, into a KV cache (num_gpu_blocks) that holds
--kv-fraction of them; one engine per preemption_mode (recompute without swap_space: the
engine as it was). Reports throughput, p50/p99 time to
first token (from submission) and the engine's preemption and swap counts.

tier: one request at a time, a --prefix-len prefix followed by a fresh --suffix-len suffix:
its time to first token cold (nothing cached), with the prefix on the GPU, and with the
prefix in the CPU tier only (evicted from the GPU by filler prompts that cycle the whole
cache); --reps prefixes, the median of each. Reports the CPU-tier hit tokens it saw.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from bench.common import add_engine_args, emit, engine_kwargs, random_prompts
from engine import LLM, SamplingParams


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_args(parser)
    parser.set_defaults(model_shape="llama3-8b", max_model_len=8192)
    parser.add_argument("--only", choices=["pressure", "tier"], default=None)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=6144)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument(
        "--kv-fraction", type=float, default=1 / 3, help="share of the workload the KV cache holds"
    )
    parser.add_argument("--swap-space", type=float, default=32.0, help="GiB of pinned CPU pool")
    parser.add_argument("--modes", nargs="+", default=["recompute", "swap"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=4096)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    return parser.parse_args(argv)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_memory() -> None:
    """After an engine is dropped: its KV cache (in reference cycles) and pinned pool go."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_requests(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str):
    """Submit all at once and step to the end: (wall seconds, each request's time to first
    token from submission, output tokens)."""
    engine = llm.engine
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    first: dict[str, float] = {}
    num_out = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - start
            if out.finished:
                num_out += len(out.outputs[0].token_ids)
    _sync()
    return time.perf_counter() - start, list(first.values()), num_out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_pressure(args, base: dict, vocab_size: int) -> None:
    workload_tokens = args.num_prompts * (args.input_len + args.output_len)
    num_blocks = 1 + -(-int(workload_tokens * args.kv_fraction) // args.block_size)
    prompts = random_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True
    )
    for mode in args.modes:
        # One engine at a time: each holds the whole KV cache.
        result = _pressure_run(args, mode, num_blocks, prompts, params)
        _free_memory()
        emit({**base, **result}, args.record)


def _pressure_run(args, mode: str, num_blocks: int, prompts, params) -> dict:
    # recompute runs as without swap_space (no pool, no CPU tier): the engine as it was.
    swap_space = 0 if mode == "recompute" else args.swap_space
    engine_args = dict(num_gpu_blocks=num_blocks, preemption_mode=mode, swap_space=swap_space)
    llm = LLM(**_engine_kwargs(args, **engine_args))
    try:
        run_requests(llm, prompts[:2], params, "warm")  # kernels built before the clock
        wall, ttfts, num_out = run_requests(llm, prompts, params, mode)
        stats = llm.engine.stats()
        offload = llm.engine.scheduler.offload
        return {
            "bench": "kv_pressure",
            "preemption_mode": mode,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "kv_blocks": num_blocks,
            "kv_fraction": round(args.kv_fraction, 3),
            "swap_space_gib": swap_space,
            "wall_s": round(wall, 2),
            "output_tok_s": round(num_out / wall, 1),
            "total_tok_s": round((num_out + args.num_prompts * args.input_len) / wall, 1),
            "ttft_p50_s": round(_percentile(ttfts, 0.5), 3),
            "ttft_p99_s": round(_percentile(ttfts, 0.99), 3),
            "num_preemptions": stats["num_preemptions"],
            "num_swap_outs": stats.get("num_swap_outs", 0),
            "swap_threshold_tokens": offload.swap_threshold_tokens if offload else None,
        }
    finally:
        llm.engine.shutdown()


def bench_tier(args, base: dict, vocab_size: int) -> None:
    result = _tier_run(args, vocab_size)
    _free_memory()
    emit({**base, **result}, args.record)


def _tier_run(args, vocab_size: int) -> dict:
    # A cache of 4 requests' worth: 5 fillers, one after the other, reuse every block of it,
    # so the prefix is left in the CPU tier alone (which holds far more than 5 requests).
    per_request = args.prefix_len + args.suffix_len + 1
    num_blocks = 1 + 4 * -(-per_request // args.block_size)
    num_fillers = 5
    llm = LLM(**_engine_kwargs(args, num_gpu_blocks=num_blocks, preemption_mode="recompute"))
    engine = llm.engine
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    pool = random_prompts(num_fillers * args.reps + 2, per_request, vocab_size, args.seed + 1)
    run_requests(llm, pool[-2:], one, "warm")
    times: dict[str, list[float]] = {"cold": [], "gpu_hit": [], "cpu_hit": []}
    cpu_hit_tokens = 0
    for rep in range(args.reps):
        prefix = random_prompts(1, args.prefix_len, vocab_size, args.seed + 100 + rep)[0]
        suffixes = random_prompts(3, args.suffix_len, vocab_size, args.seed + 200 + rep)
        times["cold"].append(run_requests(llm, [prefix + suffixes[0]], one, f"c{rep}")[1][0])
        times["gpu_hit"].append(run_requests(llm, [prefix + suffixes[1]], one, f"g{rep}")[1][0])
        for i in range(num_fillers):
            run_requests(llm, [pool[num_fillers * rep + i]], one, f"f{rep}-{i}")
        before = engine.stats().get("cpu_prefix_cache_hits", 0)
        times["cpu_hit"].append(run_requests(llm, [prefix + suffixes[2]], one, f"t{rep}")[1][0])
        cpu_hit_tokens += engine.stats().get("cpu_prefix_cache_hits", 0) - before
    llm.engine.shutdown()
    return {
        "bench": "kv_cpu_tier",
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "reps": args.reps,
        "swap_space_gib": args.swap_space,
        **{f"ttft_{k}_s": round(statistics.median(v), 4) for k, v in times.items()},
        # The CPU tier's hits per query: the prefix's full blocks when the tier served it.
        "cpu_hit_tokens_per_rep": cpu_hit_tokens // max(args.reps, 1),
    }


def _engine_kwargs(args, **overrides) -> dict:
    kwargs = engine_kwargs(args) | {"block_size": args.block_size, "swap_space": args.swap_space}
    return kwargs | overrides


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python -m bench.kv_pressure " + " ".join(argv if argv is not None else sys.argv[1:])
    base = {"engine": "kvray", "model_shape": args.model_shape or args.model, "command": command}
    from engine.models.shapes import get_shape_config

    vocab_size = get_shape_config(args.model_shape).vocab_size if args.model_shape else 32000
    if args.only in (None, "pressure"):
        bench_pressure(args, base, vocab_size)
    if args.only in (None, "tier"):
        bench_tier(args, base, vocab_size)


if __name__ == "__main__":
    main()
