"""The GPU issue's workloads for one shape, in one process (one engine start-up).

python -m bench.suite --model-shape llama3-8b [--baseline hf] [--out results.jsonl]
Workloads match the vLLM anchor's (random token prompts, EOS ignored, greedy unless noted;
bench/vllm_anchor_bench.py has the "sampled" workload and the qwen2.5-7b shape).
"""

from __future__ import annotations

import argparse
import json
import random
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
from bench.latency import measure_latency
from engine import SamplingParams

# (name, num_prompts, input_len, output_len); None lengths: uniform in [100, 1024].
WORKLOADS = {
    "llama3-8b": [
        ("latency", 1, 256, 128),
        ("batch64", 64, 512, 256),
        ("throughput", 1000, 1024, 128),
        ("decode_heavy", 1000, 128, 1024),
        ("long_context", 16, 7680, 256),  # needs --max-model-len 8192
        ("sampled", 512, None, None),
    ],
    "qwen3-0.6b": [("latency", 1, 256, 128), ("mixed", 256, None, None)],
    "llama3-70b": [("latency", 1, 256, 128), ("throughput", 1000, 1024, 128)],
    "qwen2.5-7b": [("latency", 1, 256, 128), ("sampled", 512, None, None)],
}

ASKED_FOR_ONLY = {"long_context"}
"""Workloads that run only when --only names them (they need a longer max_model_len)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--only", nargs="*", default=None, help="workload names to run")
    args = parser.parse_args(argv)
    shape = args.model_shape
    hf_tok_s = None
    batch64 = [w for w in WORKLOADS[shape] if w[0] == "batch64"]
    if args.baseline == "hf" and batch64:
        # Before kvray takes its share of the GPU memory.
        _, n, inp, out = batch64[0]
        hf_tok_s = _hf_tok_s(args, random_prompts(n, inp, 100000, args.seed), out)
    llm, startup_s = build_llm(args)
    command = "python -m bench.suite " + " ".join(argv or sys.argv[1:])
    base = {"engine": "kvray", "model_shape": shape, "command": command}
    sched = llm.engine.config.scheduler_config
    base["max_num_seqs"] = sched.max_num_seqs
    base["max_num_batched_tokens"] = sched.max_num_batched_tokens
    base["quantization"] = llm.engine.config.model.quantization
    base["kv_blocks"] = llm.engine.num_gpu_blocks
    base["kv_cache_dtype"] = llm.engine.config.cache_config.kv_cache_dtype
    emit({**base, "bench": "startup", "startup_s": round(startup_s, 1)}, args.record)
    vocab = llm.engine.vocab_size
    for name, n, inp, out in WORKLOADS[shape]:
        if (args.only and name not in args.only) or (not args.only and name in ASKED_FOR_ONLY):
            continue
        if name == "latency":
            prompts = random_prompts(1, inp, vocab, args.seed)
            ms, ttft = measure_latency(llm, prompts, out)
            nbytes = llm.engine.executor.step_weight_bytes()
            bw = copy_bandwidth_gbs()
            emit(
                {
                    **base,
                    "bench": "latency",
                    "batch_size": 1,
                    "input_len": inp,
                    "output_len": out,
                    "ms_per_token": round(ms, 3),
                    "ttft_s": round(ttft, 4),
                    "weight_gb": round(nbytes / 1e9, 2),
                    "copy_bandwidth_gbs": round(bw),
                    "roofline_ms_per_token": round(nbytes / (bw * 1e9) * 1000, 3),
                },
                args.record,
            )
            continue
        prompts, params = workload_requests(name, n, inp, out, vocab, args.seed)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        dt = time.perf_counter() - start
        n_in = sum(map(len, prompts))
        n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        result = {
            **base,
            "bench": "throughput",
            "workload": name,
            "num_prompts": n,
            "input_len": inp,
            "output_len": out,
            "wall_s": round(dt, 3),
            "requests_s": round(n / dt, 2),
            "output_tok_s": round(n_out / dt, 1),
            "total_tok_s": round((n_in + n_out) / dt, 1),
        }
        if hf_tok_s is not None and name == "batch64":
            result["baseline_output_tok_s"] = round(hf_tok_s, 1)
        emit(result, args.record)
    print(json.dumps({"done": True}))


def sampled_requests(n: int, seed: int) -> tuple[list[list[int]], list[dict]]:
    """The "sampled" workload: n prompts of 100-1024 random tokens, each with 100-1024
    output tokens, temperature 0.8 + top_p 0.95 + top_k 50, unseeded (as most servers'
    traffic; seeded rows draw a whole-vocabulary noise row each, in both engines). Drawn
    exactly as bench/vllm_anchor_bench.py draws them (tests check the two agree)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    params = [
        dict(
            temperature=0.8,
            top_p=0.95,
            top_k=50,
            max_tokens=rng.randint(100, 1024),
        )
        for _ in range(n)
    ]
    return prompts, params


def workload_requests(name, n, inp, out, vocab, seed):
    """The prompts and sampling params of one throughput workload."""
    if name == "sampled":
        prompts, params = sampled_requests(n, seed)
        return prompts, [SamplingParams(ignore_eos=True, **p) for p in params]
    if name == "mixed":
        rng = random.Random(seed)
        prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
        params = [
            SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 1024))
            for _ in range(n)
        ]
        return prompts, params
    prompts = random_prompts(n, inp, vocab, seed)
    return prompts, SamplingParams(temperature=0.0, max_tokens=out, min_tokens=out, ignore_eos=True)


def _hf_tok_s(args, prompts, out: int) -> float:
    model = hf_model_for(args, torch.bfloat16)
    ids = torch.tensor(prompts, device="cuda")
    model.generate(ids[:2], max_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=out, min_new_tokens=out, do_sample=False)
    torch.cuda.synchronize()
    tok_s = len(prompts) * out / (time.perf_counter() - start)
    del model
    torch.cuda.empty_cache()
    return tok_s


if __name__ == "__main__":
    main()
