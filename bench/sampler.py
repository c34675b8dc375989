"""Micro-benchmark of the sampler: the top-k candidate path (the default) against the
whole-vocabulary chain (its reference), over batch sizes, vocabularies and settings.

    python -m bench.sampler [--record] [--device cpu] [--batch 256 512] [--vocab 128256]
                            [--cases top_k mixed] [--iters 30]

One JSON line per (batch, vocab, case) with the median time of each path (CUDA events
around each call, the host's launch work included, on a GPU; wall clock on a CPU) and
the size of one float32 [B, V] pass. On a GPU, steps without filters or seeds take the
one-pass Triton sampler on both paths. Defaults: batch 256 / 512 / 1024 x vocab 128,256 /
151,936 on CUDA; batch 16 x vocab 8192 on a CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from bench.common import emit
from engine.sampling_params import SamplingParams
from engine.worker.sampler import sample_on_device
from engine.worker.sampling_batch import build_sampling_batch

MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
    SamplingParams(temperature=0.7, top_p=0.95),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, min_p=0.05, top_k=100),
    SamplingParams(temperature=0.8, top_k=40, seed=1),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
]
"""A cycle of per-row settings: greedy, seeded, and rows without top-k beside top-k rows."""

CASES: dict[str, Callable[[int], SamplingParams]] = {
    "temperature": lambda i: SamplingParams(temperature=0.8),
    "top_p": lambda i: SamplingParams(temperature=0.8, top_p=0.9),
    "top_k": lambda i: SamplingParams(temperature=0.8, top_k=50),
    "top_p_top_k": lambda i: SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
    "min_p": lambda i: SamplingParams(temperature=0.8, min_p=0.05),
    "mixed": lambda i: MIXED[i % len(MIXED)],
    # bench.suite's "sampled" workload: every row seeded.
    "sampled_seeded": lambda i: SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i),
}


def make_batch(params: list[SamplingParams], vocab: int, device: torch.device):
    generators = [torch.Generator(device) if p.seed is not None else None for p in params]
    n = len(params)
    return build_sampling_batch(params, [[1]] * n, [[]] * n, generators, None, vocab, device)


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def bench_case(case: str, batch_size: int, vocab: int, args, command: str) -> None:
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    # bfloat16 logits as the LM head makes them (ties included), read as float32.
    logits = (torch.randn(batch_size, vocab, generator=gen) * 3).bfloat16().to(device).float()
    params = [CASES[case](i) for i in range(batch_size)]
    batch = make_batch(params, vocab, device)
    times = {}
    for name, candidates in (("reference", False), ("candidates", True)):
        times[name] = median_ms(
            lambda c=candidates: sample_on_device(logits, batch, top_k_candidates=c),
            device,
            args.warmup,
            args.iters,
        )
    result = {
        "bench": "sampler",
        "device": args.device,
        "case": case,
        "batch_size": batch_size,
        "vocab_size": vocab,
        "reference_ms": round(times["reference"], 4),
        "candidates_ms": round(times["candidates"], 4),
        "speedup": round(times["reference"] / times["candidates"], 2),
        "logits_mb": round(batch_size * vocab * 4 / 1e6, 1),
        "command": command,
    }
    emit(result, args.record)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--batch", type=int, nargs="*", default=None)
    parser.add_argument("--vocab", type=int, nargs="*", default=None)
    parser.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--record", action="store_true", help="append to bench/results.jsonl")
    args = parser.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    batches = args.batch or ([256, 512, 1024] if on_gpu else [16])
    vocabs = args.vocab or ([128256, 151936] if on_gpu else [8192])
    command = "python -m bench.sampler " + " ".join(sys.argv[1:] if argv is None else argv)
    torch.manual_seed(0)
    for vocab in vocabs:
        for batch_size in batches:
            for case in args.cases:
                bench_case(case, batch_size, vocab, args, command.strip())
                if on_gpu:
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
