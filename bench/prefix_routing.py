"""Cache-aware routing on one GPU: two LLMServer replicas, a shared-prefix workload, each
routing policy in turn.

    python -m bench.prefix_routing --model llama3-8b --load-format dummy [--record]
    python -m bench.prefix_routing --quick   # a CPU smoke test of the bundled model

Serve runs in this process (Ray started here). For each policy (power_of_two, then
prefix_affinity) the app is deployed with two replicas of the model, each holding half the
GPU (gpu_memory_utilization 0.45 each), and the same workload is sent: `--groups` groups of
`--per-group` requests, a group's prompts sharing a `--prefix-len`-token start and each
ending in `--suffix-len` tokens of its own, in random order at `--concurrency`, streaming
`--output-len` tokens (EOS ignored). Prompts travel as text (bench/word_tokenizer.py), as a
client's would: the router sees what it sees in production. One JSON line per policy: the
time to first token (mean, P50, P90), the prefix-cache hit rate (usage's cached_tokens over
prompt tokens) and the wall time.

Two replicas on one GPU: each replica asks Serve for half of it (a bench-only override of
LLMServer's num_gpus; the app keys give a replica a whole GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

POLICIES = ("power_of_two", "prefix_affinity")
PORT = 8000


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=1536)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CPU smoke test: bundled model, tiny load")
    p.add_argument("--record", action="store_true", help="append to bench/results.jsonl")
    return p


def workload(args: argparse.Namespace, vocab: int, seed: int) -> list[str]:
    """The prompts in sending order: word-tokenizer text, one word a token."""
    rng = random.Random(seed)

    def words(n: int) -> list[str]:
        return [f"t{rng.randrange(1000, vocab - 1000)}" for _ in range(n)]

    prompts = []
    for _ in range(args.groups):
        prefix = words(args.prefix_len)
        prompts += [" ".join(prefix + words(args.suffix_len)) for _ in range(args.per_group)]
    rng.shuffle(prompts)
    return prompts


async def _one(session: Any, model: str, prompt: str, output_len: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, usage = None, None
    async with session.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            if ttft is None and (data.get("choices") or [{}])[0].get("text"):
                ttft = time.perf_counter() - start
            usage = data.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft,
        "prompt": usage["prompt_tokens"],
        "cached": details.get("cached_tokens", 0),
    }


async def run_workload(prompts: list[str], model: str, args: argparse.Namespace) -> list[dict]:
    import aiohttp

    gate = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def gated(prompt: str) -> dict:
            async with gate:
                return await _one(session, model, prompt, args.output_len)

        return await asyncio.gather(*(gated(p) for p in prompts))


def summarize(results: list[dict], wall_s: float) -> dict:
    import numpy as np

    ttft_ms = np.array([r["ttft_s"] for r in results]) * 1e3
    return {
        "requests": len(results),
        "ttft_mean_ms": round(float(ttft_ms.mean()), 1),
        "ttft_p50_ms": round(float(np.percentile(ttft_ms, 50)), 1),
        "ttft_p90_ms": round(float(np.percentile(ttft_ms, 90)), 1),
        "prefix_hit_rate": round(
            sum(r["cached"] for r in results) / sum(r["prompt"] for r in results), 3
        ),
        "wall_s": round(wall_s, 1),
    }


def app_keys(args: argparse.Namespace, tokenizer: str, policy: str) -> dict[str, Any]:
    keys: dict[str, Any] = {
        "model": args.model,
        "load_format": args.load_format,
        "tokenizer": tokenizer,
        "max_model_len": args.max_model_len,
        "min_replicas": 2,
        "max_replicas": 2,
        "routing": policy,
        "enable_prompt_tokens_details": True,
        "ingress_max_replicas": 1,
    }
    if args.quick:  # the bundled model and its tokenizer
        keys.update(model=None, load_format="auto", tokenizer=None, num_cpus=0.25)
        keys = {k: v for k, v in keys.items() if v is not None}
    else:
        keys["gpu_memory_utilization"] = args.gpu_memory_utilization
    return keys


def deploy(keys: dict[str, Any], half_gpu: bool) -> str:
    """serve.run the app of `keys`; the model's served name once it answers."""
    from ray import serve

    import cluster.deployments as deployments
    from cluster.app_config import load_app_config

    plain = deployments.llm_server_options

    def options(config):
        opts = plain(config)
        if half_gpu:
            opts["ray_actor_options"]["num_gpus"] = 0.5
        return opts

    deployments.llm_server_options = options
    try:
        serve.run(
            deployments.build_openai_app(load_app_config(keys)), name="routing", route_prefix="/"
        )
    finally:
        deployments.llm_server_options = plain
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=60) as r:
        return json.load(r)["data"][0]["id"]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.model = "bundled"
        # The bundled tokenizer reads a word "t1234" as a few tokens.
        args.max_model_len, args.groups, args.per_group = 1024, 3, 4
        args.prefix_len, args.suffix_len, args.output_len, args.concurrency = 40, 4, 2, 2
    import ray
    from ray import serve

    from bench.word_tokenizer import write_word_tokenizer
    from engine.worker.loader import load_hf_config, resolve_model_source

    vocab = 49152
    tokenizer = ""
    if not args.quick:
        vocab = load_hf_config(resolve_model_source(args.model, args.load_format)).vocab_size
        tokenizer = str(write_word_tokenizer(Path(tempfile.mkdtemp()) / "tok", vocab))
    prompts = workload(args, vocab, args.seed)
    # Warm-up prompts of other prefixes: what they leave cached is no group's.
    warm_up = workload(args, vocab, args.seed + 1)[: 2 * args.concurrency]
    ray.init(address="local", include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    command = "python -m bench.prefix_routing " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        for policy in POLICIES:
            model = deploy(app_keys(args, tokenizer, policy), half_gpu=not args.quick)
            asyncio.run(run_workload(warm_up, model, args))
            start = time.perf_counter()
            results = asyncio.run(run_workload(prompts, model, args))
            summary = {"bench": "prefix_routing", "routing": policy, "model": args.model}
            summary |= summarize(results, time.perf_counter() - start)
            summary |= {"groups": args.groups, "per_group": args.per_group, "command": command}
            summary |= {"prefix_len": args.prefix_len, "concurrency": args.concurrency}
            if args.record:
                from bench.common import emit

                emit(summary, record=True)
            else:
                print(json.dumps(summary), flush=True)
            serve.delete("routing")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
