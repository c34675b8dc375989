"""Offline throughput: random token prompts, EOS ignored (the defaults of `vllm bench throughput`).

python -m bench.throughput --model-shape llama3-8b --num-prompts 1000 --input-len 1024 --output-len 128
Mixed lengths: --min-input-len/--max-input-len/--min-output-len/--max-output-len (uniform), or
--random-range-ratio R (lengths uniform in [len * (1 - R), len * (1 + R)]).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from bench.common import add_engine_args, build_llm, emit, hf_model_for
from engine import SamplingParams


def _lengths(args: argparse.Namespace, rng: random.Random, which: str) -> list[int]:
    base = getattr(args, f"{which}_len")
    lo = getattr(args, f"min_{which}_len")
    hi = getattr(args, f"max_{which}_len")
    if lo is None and hi is None:
        r = args.random_range_ratio
        lo, hi = max(1, int(base * (1 - r))), int(base * (1 + r))
    return [rng.randint(lo, hi) for _ in range(args.num_prompts)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    for which in ("input", "output"):
        parser.add_argument(f"--min-{which}-len", type=int, default=None)
        parser.add_argument(f"--max-{which}-len", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)

    llm, startup_s = build_llm(args)
    rng = random.Random(args.seed)
    in_lens = _lengths(args, rng, "input")
    out_lens = _lengths(args, rng, "output")
    vocab = llm.engine.vocab_size
    prompts = [[rng.randint(100, min(vocab, 100000) - 1) for _ in range(n)] for n in in_lens]
    params = [
        SamplingParams(
            temperature=args.temperature, max_tokens=n, min_tokens=n, ignore_eos=True, seed=None
        )
        for n in out_lens
    ]
    # Warm-up outside the clock (first kernel compilations on a fresh process).
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2)

    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if llm.engine.config.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    n_in = sum(in_lens)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "bench": "throughput",
        "engine": "kvray",
        "model_shape": args.model_shape or args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len if args.min_input_len is None else [min(in_lens), max(in_lens)],
        "output_len": args.output_len
        if args.min_output_len is None
        else [min(out_lens), max(out_lens)],
        "wall_s": round(elapsed, 3),
        "requests_s": round(args.num_prompts / elapsed, 2),
        "output_tok_s": round(n_out / elapsed, 1),
        "total_tok_s": round((n_in + n_out) / elapsed, 1),
        "startup_s": round(startup_s, 1),
        "command": "python -m bench.throughput " + " ".join(argv or sys.argv[1:]),
    }
    if args.baseline == "hf":
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()
        result["baseline_output_tok_s"] = round(_hf_output_tok_s(args, prompts, out_lens), 1)
    emit(result, args.record)
    return result


def _hf_output_tok_s(args: argparse.Namespace, prompts: list[list[int]], out_lens) -> float:
    """transformers generate() on equal-length batches (its padding would change the work)."""
    if len(set(map(len, prompts))) != 1 or len(set(out_lens)) != 1:
        raise SystemExit("--baseline hf needs fixed input and output lengths")
    model = hf_model_for(args, torch.bfloat16)
    ids = torch.tensor(prompts, device="cuda")
    n = out_lens[0]
    model.generate(ids[:2], max_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    torch.cuda.synchronize()
    return len(prompts) * n / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
