"""What a request's steps cost right after the machine was idle, against back to back.

    python -m bench.wakeups [--record]

A request at concurrency 1 arrives after its predecessor's whole decode: every process on
its path has been asleep, and in a virtual machine a sleeping vCPU may have been halted.
This measures, for idle gaps of 0 (back to back), 50 ms and 600 ms (one 128-token
decode): the round trip of a small message between two processes over a pipe (one hop
each way, as between a replica and its engine process), and the encoding of a 1,024-word
prompt with the benchmark tokenizer. Medians, with the CPU's idle driver and governor.
`--cpus 2,3` pins this process (and the encoding) to CPU 2 and the echo process to CPU 3
(`--cpus 3`: both on 3): whether a process that wakes where it slept runs warmer than one
the kernel places on any idle CPU.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import emit, read_setting

GAPS_S = (0.0, 0.05, 0.6)


def _echo(conn, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    while True:
        message = conn.recv()
        if message is None:
            return
        conn.send(message)


def _timed(step, gap_s: float, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--cpus", help="CPU of this process[,CPU of the echo process]")
    args = parser.parse_args(argv)
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else []
    if cpus:
        os.sched_setaffinity(0, {cpus[0]})

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    echo = ctx.Process(target=_echo, args=(child, cpus[-1] if cpus else None), daemon=True)
    echo.start()
    payload = b"x" * 256

    def round_trip() -> None:
        conn.send(payload)
        conn.recv()

    from bench.word_tokenizer import write_word_tokenizer
    from engine.tokenizer import encode_text, load_tokenizer

    tokenizer = load_tokenizer(write_word_tokenizer(Path(tempfile.mkdtemp()) / "tok"))
    rng = random.Random(0)
    text = " ".join(f"t{rng.randrange(128256)}" for _ in range(1024))

    result: dict = {
        "bench": "wakeups",
        "cpuidle_driver": read_setting("/sys/devices/system/cpu/cpuidle/current_driver"),
        "cpuidle_governor": read_setting("/sys/devices/system/cpu/cpuidle/current_governor_ro"),
        "cpus": multiprocessing.cpu_count(),
        "pinned_to": args.cpus,
    }
    for _ in range(50):  # warm both
        round_trip()
        encode_text(tokenizer, text)
    for gap in GAPS_S:
        repeats = 300 if gap == 0 else (60 if gap < 0.5 else 20)
        name = f"{round(gap * 1000)}ms"
        result[f"pipe_round_trip_us_after_{name}"] = _timed(round_trip, gap, repeats)
        step = lambda: encode_text(tokenizer, text)  # noqa: E731
        result[f"encode_1024_words_us_after_{name}"] = _timed(step, gap, repeats)
    conn.send(None)
    echo.join(5)
    emit(result, args.record)


if __name__ == "__main__":
    main()
