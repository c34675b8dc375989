"""Keep every CPU out of idle with one lowest-priority busy loop per CPU, until killed.

    python -m bench.keep_awake [--cpus 0-15]

An experiment for wake-up cost (bench/wakeups.py): in a virtual machine whose CPUs have no
idle driver, an idle vCPU halts and waking it takes the hypervisor's time. A SCHED_IDLE
loop pinned to a CPU keeps it running; the scheduler counts such a CPU as idle, places
woken work there and preempts the loop at once.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import signal

_PR_SET_PDEATHSIG = 1


def _spin(cpu: int) -> None:
    # Ends with its parent, however the parent ends (a loop left behind would measure
    # every later run on a machine with one CPU fewer).
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


def start(cpus: set[int] | None = None) -> list[multiprocessing.Process]:
    ctx = multiprocessing.get_context("spawn")
    spinners = []
    for cpu in sorted(cpus if cpus is not None else os.sched_getaffinity(0)):
        process = ctx.Process(target=_spin, args=(cpu,), daemon=True)
        process.start()
        spinners.append(process)
    return spinners


def stop(spinners: list[multiprocessing.Process]) -> None:
    for process in spinners:
        process.kill()
    for process in spinners:
        process.join(5)


def _cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cpus", type=_cpu_list, default=None)
    args = parser.parse_args(argv)
    spinners = start(args.cpus)
    print(f"keeping {len(spinners)} CPUs awake", flush=True)
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # sigwait takes them, not Python
    try:
        signal.sigwait(stop_signals)
    finally:
        stop(spinners)


if __name__ == "__main__":
    main()
