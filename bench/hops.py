"""Where concurrency 1's time to first token goes, hop by hop (engine/observability/hop_trace.py).

    KVRAY_HOP_TRACE=DIR <run bench.serve, through a server started with it, or in process>
    python -m bench.hops DIR

Every request the benchmark timed is a window from its send (`client_send`, or
`inproc_start` in process) to its first token (`client_first` / `inproc_first`). Each hop
of any process inside the window (and up to 0.3 ms after, for the server's own record of
the first chunk) is numbered by its order there (`reader_recv#2`: the second message the
engine's reader took) and its median offset from the send is printed, for the Serve path
and the in-process path apart. Meant for one request at a time: with several in flight
the windows overlap and hops of other requests fall into them.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
from collections import Counter, defaultdict
from pathlib import Path

_STARTS = {"client_send": "serve", "inproc_start": "in process"}
_ENDS = {"client_first", "inproc_first"}
_LATE_NS = 300_000


def load(folder: Path) -> list[tuple[int, str]]:
    """Every hop of every process, in time order: (nanoseconds, label)."""
    events = []
    for path in folder.glob("*.log"):
        for line in path.read_text().splitlines():
            label, _pid, ns = line.split()
            events.append((int(ns), label))
    events.sort()
    return events


def windows(events: list[tuple[int, str]]) -> list[tuple[str, int, int]]:
    """(path, send, first token) of each request that got its first token."""
    found, open_at = [], None
    for ns, label in events:
        if label in _STARTS:
            open_at = (_STARTS[label], ns)
        elif label in _ENDS and open_at is not None:
            found.append((open_at[0], open_at[1], ns))
            open_at = None
    return found


def offsets(events: list[tuple[int, str]]) -> dict[str, dict[str, list[float]]]:
    """path -> numbered hop -> its offsets from the send (ms), one per request."""
    times = [ns for ns, _ in events]
    by_path: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path, start, end in windows(events):
        seen: Counter[str] = Counter()
        i = bisect.bisect_left(times, start)
        while i < len(events) and events[i][0] <= end + _LATE_NS:
            ns, label = events[i]
            seen[label] += 1
            by_path[path][f"{label}#{seen[label]}"].append((ns - start) / 1e6)
            i += 1
    return by_path


def report(by_path: dict[str, dict[str, list[float]]]) -> str:
    lines = []
    for path, hops in by_path.items():
        requests = max(len(v) for v in hops.values())
        lines.append(f"{path}: {requests} requests, median ms from the send")
        # Hops most requests have, in the order of their medians.
        common = [(k, v) for k, v in hops.items() if len(v) >= 0.8 * requests]
        for key, values in sorted(common, key=lambda kv: statistics.median(kv[1])):
            lines.append(f"  {key:24s} {statistics.median(values):8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    print(report(offsets(load(args.folder))))


if __name__ == "__main__":
    main()
