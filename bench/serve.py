"""Online serving benchmark against any OpenAI-compatible server (kvray, vLLM, ...).

    python -m bench.serve --base-url http://127.0.0.1:8000 --tokenizer DIR \\
        --num-prompts 500 --request-rate 16 --random-input-len 1024 --random-output-len 128 \\
        --ignore-eos --seed 21

Requests stream (`stream_options.include_usage`), arrive as a Poisson process at
--request-rate (inf: all at once) under an optional --max-concurrency cap. Reports TTFT,
TPOT, ITL and end-to-end latency (mean and percentiles), request and token throughput,
and goodput under an SLO (--goodput ttft:200 tpot:50, in ms); one JSON object out.

--in-process MODEL runs the same workload against kvray's engine in this process (an
AsyncEngine, no Serve, no HTTP; engine arguments as --engine-arg key=value), so that the
cost of the Serve + HTTP path is the difference between two runs of this script.
--paired-in-process MODEL (one request at a time) sends every prompt both ways in turns,
server and engine alternating which goes first, and reports that difference request by
request: on a machine whose CPUs change speed from minute to minute (a virtual machine's
often do), two runs minutes apart differ by more than the path's cost. With --paired-block
N the turns take N prompts each: a block's first request comes after the other path's
block (its processes idle meanwhile), the others back to back after one of their own, as
requests at a steady concurrency 1 come; both kinds are reported apart.

Prompts: random token ids of the requested lengths (--dataset random, lengths uniform in
len * [1 - ratio, 1 + ratio]) or a ShareGPT-like lognormal mix (--dataset lognormal).
With --tokenizer they are sent as text (decoded ids; a word-level tokenizer round-trips
exactly), without one as token-id prompts. Give each run its own --seed: a repeated seed
repeats the prompts and rides the prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

import kvray_env


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    sent_at: float = 0.0
    """time.perf_counter() when the request went out."""

    @property
    def tpot_s(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)


def make_requests(args: argparse.Namespace, tokenizer: Any | None) -> list[tuple[Any, int, int]]:
    """(prompt, prompt_len, max_tokens) for every request, deterministic in --seed."""
    rng = random.Random(args.seed)
    vocab = len(tokenizer) if tokenizer is not None else args.vocab_size
    requests = []
    for _ in range(args.num_prompts):
        if args.dataset == "lognormal":
            n_in = _lognormal(
                rng, args.lognormal_input_median, args.lognormal_sigma, args.max_input_len
            )
            n_out = _lognormal(
                rng, args.lognormal_output_median, args.lognormal_sigma, args.max_output_len
            )
        else:
            n_in = _uniform(rng, args.random_input_len, args.random_range_ratio)
            n_out = _uniform(rng, args.random_output_len, args.random_range_ratio)
        ids = [rng.randrange(min(100, vocab - 1), vocab) for _ in range(n_in)]
        if tokenizer is None:
            requests.append((ids, n_in, n_out))
            continue
        # Decode and re-encode: BPE merges can change the length, so the text is cut to
        # n_in tokens of its own encoding (a word-level tokenizer round-trips exactly).
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)[:n_in]
        requests.append((tokenizer.decode(ids), len(ids), n_out))
    return requests


def _uniform(rng: random.Random, length: int, ratio: float) -> int:
    return rng.randint(max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio))))


def _lognormal(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return max(1, min(cap, int(rng.lognormvariate(np.log(median), sigma))))


@functools.cache
def _hop() -> Any:
    """engine.observability.hop_trace.hop where `kvray_env.HOP_TRACE` is set (it imports the
    engine), else a no-op: the client's send and first token, beside the server's hops."""
    if not kvray_env.hop_trace_folder():
        return lambda label: None
    from engine.observability.hop_trace import hop

    return hop


async def send(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    prompt: Any,
    prompt_len: int,
    max_tokens: int,
) -> RequestResult:
    chat = args.endpoint.endswith("chat/completions")
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    result = RequestResult(ok=False, prompt_len=prompt_len)
    hop = _hop()
    hop("client_send")
    start = last = result.sent_at = time.perf_counter()
    chunks = 0
    try:
        async with session.post(args.base_url + args.endpoint, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    # Read on to the end of the response (as a client library does): a
                    # response left unfinished closes its connection, and the next request
                    # would pay for a new one.
                    continue
                data = json.loads(payload)
                if "error" in data:
                    result.error = data["error"].get("message", str(data["error"]))
                    return result
                if data.get("usage"):
                    result.output_len = data["usage"]["completion_tokens"]
                    result.prompt_len = data["usage"]["prompt_tokens"]
                choices = data.get("choices") or []
                if not choices or not _has_content(choices[0], chat):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    hop("client_first")
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                chunks += 1
    except (TimeoutError, aiohttp.ClientError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.output_len = result.output_len or chunks
    result.ok = chunks > 0
    return result


async def send_in_process(
    engine: Any, args: argparse.Namespace, prompt: Any, prompt_len: int, max_tokens: int
) -> RequestResult:
    """One request straight into the engine; a "chunk" is an output with new tokens, as an
    SSE chunk is one engine step's tokens. A text prompt is tokenized here, inside the
    timed span, as a Serve replica tokenizes before it hands ids to its engine."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos
    )
    result = RequestResult(ok=False, prompt_len=prompt_len)
    hop = _hop()
    hop("inproc_start")
    start = last = result.sent_at = time.perf_counter()
    num_tokens = 0
    try:
        ids = engine.encode(prompt) if isinstance(prompt, str) else prompt
        async for output in engine.generate(ids, params, f"bench-{next(_REQUEST_IDS)}"):
            n = len(output.outputs[0].token_ids)
            if n == num_tokens:
                continue
            now = time.perf_counter()
            if num_tokens == 0:
                hop("inproc_first")
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last, num_tokens = now, n
            result.prompt_len = len(output.prompt_token_ids)
    except ValueError as e:
        result.error = f"ValueError: {e}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.output_len = num_tokens
    result.ok = num_tokens > 0
    return result


_REQUEST_IDS = itertools.count()


def _has_content(choice: dict, chat: bool) -> bool:
    if chat:
        return bool((choice.get("delta") or {}).get("content"))
    return bool(choice.get("text"))


async def _arrive(args: argparse.Namespace, requests, one) -> tuple[list[RequestResult], float]:
    """Start `one(request)` for every request, Poisson-spaced at --request-rate."""
    rng = np.random.default_rng(args.seed)
    tasks = []
    start = time.perf_counter()
    for request in requests:
        tasks.append(asyncio.create_task(one(request)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


async def run_in_process(
    args: argparse.Namespace, requests: list[tuple[Any, int, int]], engine: Any
) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
    args.model = engine.model_name

    async def one(request: tuple[Any, int, int]) -> RequestResult:
        async with limit:
            return await send_in_process(engine, args, *request)

    return await _arrive(args, requests, one)


async def run(
    args: argparse.Namespace, requests: list[tuple[Any, int, int]]
) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    headers = dict(args.header)
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        timeout=timeout, headers=headers, connector=connector
    ) as session:
        if args.model is None:
            async with session.get(args.base_url + "/v1/models") as response:
                args.model = (await response.json())["data"][0]["id"]

        async def one(request: tuple[Any, int, int]) -> RequestResult:
            async with limit:
                return await send(session, args, *request)

        return await _arrive(args, requests, one)


async def run_paired(
    args: argparse.Namespace, requests: list[tuple[Any, int, int]], engine: Any
) -> tuple[list[RequestResult], list[RequestResult], list[bool], float]:
    """Each block of --paired-block requests to the server and to the in-process engine,
    one path after the other, in the order server-engine, engine-server, engine-server,
    server-engine, ... (ABBA), so that a drift of the machine's speed and whatever one
    path leaves behind for the next fall on both alike. Returns (server results, engine
    results, whether each request followed one of its own path, duration)."""
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    headers = dict(args.header)
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    served: list[RequestResult] = []
    local: list[RequestResult] = []
    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        if args.model is None:
            async with session.get(args.base_url + "/v1/models") as response:
                args.model = (await response.json())["data"][0]["id"]
        size = args.paired_block
        for k in range(0, len(requests), size):
            block = requests[k : k + size]
            server_first = (k // size) % 4 in (0, 3)
            for path in ("server", "engine") if server_first else ("engine", "server"):
                for request in block:
                    if path == "server":
                        served.append(await send(session, args, *request))
                    else:
                        local.append(await send_in_process(engine, args, *request))
    followed_own = [k % args.paired_block > 0 for k in range(len(requests))]
    return served, local, followed_own, time.perf_counter() - start


def paired_difference(
    served: list[RequestResult], local: list[RequestResult], followed_own: list[bool]
) -> dict:
    """The in-process figures and what the server path added, pair by pair (both done);
    with blocks, also over the pairs whose requests each followed one of their own path
    (`*_steady_*`)."""
    pairs = [(s, x) for s, x in zip(served, local, strict=True) if s.ok and x.ok]
    out = _paired_figures(pairs, "")
    if any(followed_own):
        steady = [
            (s, x)
            for s, x, own in zip(served, local, followed_own, strict=True)
            if own and s.ok and x.ok
        ]
        out |= _paired_figures(steady, "_steady")
    return out


def _paired_figures(pairs: list[tuple[RequestResult, RequestResult]], kind: str) -> dict:
    out: dict[str, Any] = {f"paired{kind}_requests": len(pairs)}
    if not pairs:
        return out
    out |= _added_ttft(
        np.array([s.ttft_s for s, _ in pairs]) * 1000,
        np.array([x.ttft_s for _, x in pairs]) * 1000,
        kind,
    )
    if kind:
        return out
    tpot = [x.tpot_s for _, x in pairs if x.tpot_s is not None]
    if tpot:
        out["in_process_mean_tpot_ms"] = round(float(np.mean(tpot)) * 1000, 3)
    return out


def _added_ttft(served_ms: np.ndarray, local_ms: np.ndarray, kind: str) -> dict:
    added = served_ms - local_ms
    out = {
        f"server_mean_ttft{kind}_ms": round(float(served_ms.mean()), 3),
        f"in_process_mean_ttft{kind}_ms": round(float(local_ms.mean()), 3),
        f"in_process_p50_ttft{kind}_ms": round(float(np.median(local_ms)), 3),
        f"added_mean_ttft{kind}_ms": round(float(added.mean()), 3),
        f"added_p50_ttft{kind}_ms": round(float(np.median(added)), 3),
    }
    # A bootstrap 95 % interval of the mean added TTFT (fixed seed: the same data, the
    # same interval).
    rng = np.random.default_rng(0)
    means = added[rng.integers(0, len(added), size=(2000, len(added)))].mean(axis=1)
    out[f"added_mean_ttft{kind}_ci95_ms"] = [
        round(float(np.percentile(means, 2.5)), 3),
        round(float(np.percentile(means, 97.5)), 3),
    ]
    return out


def summarize(args: argparse.Namespace, results: list[RequestResult], duration_s: float) -> dict:
    done = [r for r in results if r.ok]
    pcts = [float(p) for p in args.percentiles.split(",")]
    metrics = {
        "ttft": [r.ttft_s for r in done],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [t for r in done for t in r.itl_s],
        "e2el": [r.e2e_s for r in done],
    }
    out: dict[str, Any] = {
        "bench": "serve",
        "base_url": "in-process" if args.in_process else args.base_url,
        "endpoint": args.endpoint,
        "model": args.model,
        "dataset": args.dataset,
        "num_prompts": len(results),
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": round(duration_s, 3),
        "total_input_tokens": sum(r.prompt_len for r in done),
        "total_output_tokens": sum(r.output_len for r in done),
    }
    out["request_throughput"] = round(len(done) / duration_s, 3)
    out["output_throughput"] = round(out["total_output_tokens"] / duration_s, 1)
    out["total_token_throughput"] = round(
        (out["total_input_tokens"] + out["total_output_tokens"]) / duration_s, 1
    )
    for name, values in metrics.items():
        ms = np.asarray(values) * 1000 if values else np.zeros(1)
        out[f"mean_{name}_ms"] = round(float(ms.mean()), 3)
        for p in pcts:
            out[f"p{p:g}_{name}_ms"] = round(float(np.percentile(ms, p)), 3)
    if args.goodput:
        slo = parse_slo(args.goodput)
        good = sum(1 for r in done if _meets(r, slo))
        out["goodput_slo_ms"] = slo
        out["goodput"] = round(good / duration_s, 3)
    if done:
        # Where the slowest first tokens fall in the run: all at its start points to work
        # done on first use, spread over it to the load.
        first_sent = min(r.sent_at for r in results)
        slowest = sorted(done, key=lambda r: r.ttft_s, reverse=True)[:5]
        out["slowest_ttft_ms_at_s"] = [
            [round(r.ttft_s * 1000, 1), round(r.sent_at - first_sent, 2)] for r in slowest
        ]
    errors = [r.error for r in results if not r.ok]
    if errors:
        out["first_error"] = errors[0]
    return out


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE strings -> engine arguments; values are parsed as JSON where they can be."""
    engine_args: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg wants KEY=VALUE, got {item!r}")
        try:
            engine_args[key] = json.loads(value)
        except json.JSONDecodeError:
            engine_args[key] = value
    return engine_args


def parse_slo(items: list[str]) -> dict[str, float]:
    slo = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        slo[name] = float(value)
    return slo


def _meets(r: RequestResult, slo: dict[str, float]) -> bool:
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2el": r.e2e_s}
    return all(values[name] * 1000 <= limit for name, limit in slo.items())


def _header(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a header is NAME=VALUE, got {item!r}")
    return name, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"]
    )
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--header",
        action="append",
        default=[],
        type=_header,
        metavar="NAME=VALUE",
        help="an HTTP header sent with every request (repeatable), e.g. X-Tenant-Id=a",
    )
    p.add_argument("--tokenizer", default=None, help="HF folder or .gguf: send text prompts")
    p.add_argument("--vocab-size", type=int, default=32000, help="token-id prompts: ids below this")
    p.add_argument("--dataset", choices=["random", "lognormal"], default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--lognormal-input-median", type=int, default=256)
    p.add_argument("--lognormal-output-median", type=int, default=192)
    p.add_argument("--lognormal-sigma", type=float, default=0.9)
    p.add_argument("--max-input-len", type=int, default=3072)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate (req/s)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS")
    p.add_argument("--timeout-s", type=float, default=6 * 3600)
    p.add_argument("--result-file", default=None, help="write the JSON summary here")
    p.add_argument("--label", default=None, help="a name for this run, kept in the JSON")
    p.add_argument("--record", action="store_true", help="append to bench/results.jsonl")
    p.add_argument(
        "--in-process",
        default=None,
        metavar="MODEL",
        help="run kvray's engine in this process instead of calling --base-url",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine argument for --in-process (repeatable), e.g. load_format=dummy",
    )
    p.add_argument(
        "--paired-in-process",
        default=None,
        metavar="MODEL",
        help="with --max-concurrency 1: every prompt to --base-url and to kvray's engine in "
        "this process, in turns; reports what the server path added, pair by pair",
    )
    p.add_argument(
        "--paired-block",
        type=int,
        default=1,
        metavar="N",
        help="with --paired-in-process: N prompts a turn (the first of each after the other "
        "path's turn, the rest back to back); figures of the rest apart as *_steady_*",
    )
    return p


def main(argv: list[str] | None = None, command: str | None = None) -> dict:
    """`command`: the line recorded with the result (default: this module's own)."""
    args = build_parser().parse_args(argv)
    tokenizer = None
    if args.tokenizer is not None:
        from engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    elif args.endpoint.endswith("chat/completions"):
        raise SystemExit("chat prompts are text: give --tokenizer")
    engine_model = args.in_process or args.paired_in_process
    if engine_model and args.endpoint.endswith("chat/completions"):
        raise SystemExit("the in-process engine takes prompts as completions: leave --endpoint")
    if args.in_process and args.paired_in_process:
        raise SystemExit("give --in-process or --paired-in-process, not both")
    if args.paired_in_process and (args.max_concurrency != 1 or args.request_rate != float("inf")):
        raise SystemExit("--paired-in-process sends one request at a time: --max-concurrency 1")
    if args.paired_block < 1:
        raise SystemExit("--paired-block must be >= 1")
    requests = make_requests(args, tokenizer)
    paired = {}
    if engine_model:
        from engine.async_engine import AsyncEngine

        engine = AsyncEngine.from_engine_args(
            model=engine_model, tokenizer=args.tokenizer, **parse_engine_args(args.engine_arg)
        )
        try:
            if args.paired_in_process:
                results, local, followed_own, _ = asyncio.run(run_paired(args, requests, engine))
                paired = paired_difference(results, local, followed_own)
                # The server's own time: its requests ran back to back with the engine's.
                duration_s = sum(r.e2e_s for r in results) or 1e-9
            else:
                results, duration_s = asyncio.run(run_in_process(args, requests, engine))
        finally:
            engine.shutdown()
    else:
        results, duration_s = asyncio.run(run(args, requests))
    summary = summarize(args, results, duration_s) | paired
    if args.label:
        summary["label"] = args.label
    argv = sys.argv[1:] if argv is None else argv
    summary["command"] = command or "python -m bench.serve " + shlex.join(argv)
    if args.result_file:
        with open(args.result_file, "w") as f:
            f.write(json.dumps(summary) + "\n")
    if args.record:
        from bench.common import emit

        emit(summary, record=True)
    else:
        print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
