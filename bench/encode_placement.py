"""Where a prompt's encoding runs slower: which thread loaded the tokenizer and which thread
encodes, malloc's huge pages, a Ray actor's event loop.

    python -m bench.encode_placement [--ray] [--record]

At concurrency 1 the same tokenizer encodes the same prompts slower in a Serve replica
than in the benchmark's process (0.2-0.55 ms of a 1,024-word prompt, bench/RESULTS.md).
A replica builds its engine, tokenizer included, on a worker thread and encodes on its
event loop's thread; the benchmark loads and encodes on its main thread (either way the
Rust tokenizer hands a one-prompt batch to its own thread pool unless
TOKENIZERS_PARALLELISM is off). Each case runs in a fresh process: distinct 1,024-word
prompts with the benchmark tokenizer, each encoded after an idle gap (as at concurrency
1); medians in microseconds and the process's page faults per encoding.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import emit, read_setting

GAPS_S = {"50ms": (0.05, 40), "600ms": (0.6, 10)}
HUGE_PAGES = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
NO_TRIM = {"MALLOC_TRIM_THRESHOLD_": str(256 << 20), "MALLOC_TOP_PAD_": str(64 << 20)}
CASES = {
    "load_main_encode_main": ({}, "main", "main"),
    "load_thread_encode_thread": ({}, "thread", "thread"),
    "huge_pages_load_thread_encode_thread": (HUGE_PAGES, "thread", "thread"),
    "no_trim_load_thread_encode_thread": (NO_TRIM, "thread", "thread"),
    "no_rayon_load_thread_encode_thread": (
        {"TOKENIZERS_PARALLELISM": "false"},
        "thread",
        "thread",
    ),
}
RAY_CASES = {"ray_actor": {}, "ray_actor_huge_pages": HUGE_PAGES, "ray_actor_no_trim": NO_TRIM}


def _prompts(count: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(f"t{rng.randrange(128256)}" for _ in range(1024)) for _ in range(count)]


def _load(folder: str):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(folder)


def _huge_pages_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


async def _measure(tokenizer, sleep) -> dict:
    """Medians (us) of encoding distinct prompts after each gap; `await sleep(s)` idles."""
    from engine.tokenizer import encode_text

    prompts = iter(_prompts(200))
    for _ in range(20):
        encode_text(tokenizer, next(prompts))
    result = {}
    for name, (gap, repeats) in GAPS_S.items():
        times, faults = [], 0
        for _ in range(repeats):
            text = next(prompts)
            await sleep(gap)
            before = _faults()
            start = time.perf_counter()
            encode_text(tokenizer, text)
            times.append(time.perf_counter() - start)
            faults += _faults() - before
        result[f"encode_us_after_{name}"] = round(statistics.median(times) * 1e6, 1)
        result[f"page_faults_per_encode_after_{name}"] = round(faults / repeats, 1)
    result["anon_huge_pages_kb"] = _huge_pages_kb()
    return result


async def _blocking_sleep(seconds: float) -> None:
    """The plain cases' idle: the encoding thread sleeps outright, no event loop turns."""
    time.sleep(seconds)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _on(where: str, fn, *args):
    if where == "main":
        return fn(*args)
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn(*args)))
    thread.start()
    thread.join()
    return box[0]


def run_case(folder: str, load_on: str, encode_on: str) -> dict:
    tokenizer = _on(load_on, _load, folder)
    return _on(encode_on, asyncio.run, _measure(tokenizer, _blocking_sleep))


def run_ray_actor(folder: str, env: dict) -> dict:
    """An async Ray actor built as a replica is: the tokenizer loaded on a worker thread
    (asyncio.to_thread), prompts encoded on the actor's event loop between sleeps."""
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0, runtime_env={"env_vars": env})
    class Encoder:
        async def __init__(self, folder: str) -> None:
            self.tokenizer = await asyncio.to_thread(_load, folder)

        async def measure(self) -> dict:
            return await _measure(self.tokenizer, asyncio.sleep)

    actor = Encoder.remote(folder)
    result = ray.get(actor.measure.remote())
    ray.shutdown()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--ray", action="store_true", help="also a Ray actor built as a replica")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every case, in turn")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.case in RAY_CASES:
        print(json.dumps(run_ray_actor(args.folder, RAY_CASES[args.case])))
        return
    if args.case is not None:
        _, load_on, encode_on = CASES[args.case]
        print(json.dumps(run_case(args.folder, load_on, encode_on)))
        return

    from bench.word_tokenizer import write_word_tokenizer

    folder = str(write_word_tokenizer(Path(tempfile.mkdtemp()) / "tok"))
    result: dict = {
        "bench": "encode_placement",
        "transparent_hugepage": read_setting("/sys/kernel/mm/transparent_hugepage/enabled"),
        "glibc": os.confstr("CS_GNU_LIBC_VERSION"),
    }
    cases = list(CASES) + (list(RAY_CASES) if args.ray else [])
    for round_ in range(args.rounds):
        for case in cases:
            env = {**os.environ, **(CASES[case][0] if case in CASES else {})}
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.encode_placement",
                    "--case",
                    case,
                    "--folder",
                    folder,
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            figures = json.loads(out.strip().splitlines()[-1])
            for key, value in figures.items():
                result[f"{case}_{key}_{round_}"] = value
            print(case, round_, figures, file=sys.stderr, flush=True)
    emit(result, args.record)


if __name__ == "__main__":
    main()
