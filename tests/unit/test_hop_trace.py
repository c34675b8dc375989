"""Hop traces (engine/observability/hop_trace.py, bench/hops.py): every process of a request writes its
hops on one clock, and the benchmark's windows put them in the order the request took."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from bench import hops
from bench import serve as serve_bench
from engine.async_engine import AsyncEngine
from engine.observability import hop_trace


def _write(folder: Path, pid: int, lines: list[tuple[str, int]]) -> None:
    with open(folder / f"{pid}.log", "a") as f:
        for label, ns in lines:
            f.write(f"{label} {pid} {ns}\n")


def test_hops_are_numbered_per_window_and_paths_kept_apart(tmp_path):
    ms = 1_000_000
    # Two requests through a server (client 1, replica 2), one in process (client 1).
    _write(tmp_path, 1, [("client_send", 0), ("client_first", 10 * ms)])
    _write(tmp_path, 2, [("handler_start", 1 * ms), ("reader_recv", 2 * ms)])
    _write(tmp_path, 2, [("reader_recv", 9 * ms)])
    _write(tmp_path, 1, [("client_send", 100 * ms), ("client_first", 112 * ms)])
    _write(tmp_path, 2, [("handler_start", 103 * ms), ("reader_recv", 104 * ms)])
    _write(tmp_path, 2, [("reader_recv", 111 * ms), ("send_body", 112 * ms + 100_000)])
    _write(tmp_path, 1, [("inproc_start", 200 * ms), ("inproc_first", 205 * ms)])
    # Past the window and its 0.3 ms of grace: not counted.
    _write(tmp_path, 2, [("reader_recv", 205 * ms + 400_000)])

    by_path = hops.offsets(hops.load(tmp_path))

    serve = by_path["serve"]
    assert serve["handler_start#1"] == [1.0, 3.0]
    assert serve["reader_recv#1"] == [2.0, 4.0]
    assert serve["reader_recv#2"] == [9.0, 11.0]
    assert serve["send_body#1"] == [12.1]
    assert serve["client_first#1"] == [10.0, 12.0]
    assert dict(by_path["in process"]) == {"inproc_start#1": [0.0], "inproc_first#1": [5.0]}
    report = hops.report(by_path)
    assert "serve: 2 requests" in report and "in process: 1 requests" in report
    # Medians in order: the replica's hops before the client's first token.
    lines = [line.split()[0] for line in report.splitlines() if line.startswith("  ")]
    assert lines[:5] == [
        "client_send#1",
        "handler_start#1",
        "reader_recv#1",
        "reader_recv#2",
        "client_first#1",
    ]


@pytest.fixture
def traced(tmp_path, monkeypatch):
    """This process and the engine processes it starts trace into tmp_path."""
    monkeypatch.setenv("KVRAY_HOP_TRACE", str(tmp_path))
    hop_trace.start(str(tmp_path))
    serve_bench._hop.cache_clear()
    yield tmp_path
    hop_trace.start(None)
    serve_bench._hop.cache_clear()


def test_an_in_process_request_is_traced_through_its_engine_process(traced):
    engine = AsyncEngine.from_engine_args(max_model_len=256, max_num_seqs=4, engine_process=True)
    args = argparse.Namespace(temperature=0.0, ignore_eos=True)
    try:
        for _ in range(2):
            result = asyncio.run(
                serve_bench.send_in_process(engine, args, "The capital of France is", 5, 4)
            )
            assert result.ok and result.output_len == 4
    finally:
        engine.shutdown()

    # This process and the engine process each wrote their own hops.
    assert len(list(traced.glob("*.log"))) == 2
    path = hops.offsets(hops.load(traced))["in process"]
    order = [
        "inproc_start#1",
        "encode_start#1",
        "encoded#1",
        "submit#1",
        "engine_got_add#1",
        "engine_sent_tokens#1",
        "inproc_first#1",
    ]
    for request in range(2):
        times = [path[hop][request] for hop in order]
        assert times == sorted(times), dict(zip(order, times, strict=True))
    # The engine's first message (the request taken) comes back before its first tokens.
    assert path["reader_recv#1"][0] < path["engine_sent_tokens#1"][0]


def test_start_and_stop_tracing_this_process(tmp_path):
    hop_trace.start(str(tmp_path))
    try:
        hop_trace.hop("submit")
    finally:
        hop_trace.start(None)
    hop_trace.hop("reader_recv")
    (log,) = tmp_path.glob("*.log")
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["submit"]
    assert not hop_trace.enabled()


def test_a_folder_it_cannot_write_stops_tracing_instead_of_failing(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    hop_trace.start(str(blocked / "hops"))  # under a file: no folder can be made there
    try:
        hop_trace.hop("submit")
        hop_trace.hop("reader_recv")
        assert not hop_trace.enabled()
    finally:
        hop_trace.start(None)
    assert [r.message for r in caplog.records if "hop traces stop" in r.message] != []
