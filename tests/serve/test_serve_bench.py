"""bench/serve.py against a scripted OpenAI-style SSE server with known timings."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from bench import serve as bench

TOKENS = 5
FIRST_DELAY_S = 0.05
GAP_S = 0.02


CLIENT_PORTS: list[int] = []
HEADERS: list[dict[str, str]] = []
PROMPT_LENS: list[int] = []


async def _completions(request: web.Request) -> web.StreamResponse:
    CLIENT_PORTS.append(request.transport.get_extra_info("peername")[1])
    HEADERS.append(dict(request.headers))
    body = await request.json()
    PROMPT_LENS.append(len(body["prompt"]))
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    if body["max_tokens"] > 100:
        return web.json_response({"error": {"message": "too long"}}, status=400)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.sleep(FIRST_DELAY_S)
    for i in range(TOKENS):
        if i:
            await asyncio.sleep(GAP_S)
        chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": TOKENS, "total_tokens": 0}
    await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "scripted"}]})


@pytest.fixture(scope="module")
def base_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


def test_latency_metrics_match_the_server_timing(base_url, tmp_path):
    out = tmp_path / "result.json"
    summary = bench.main(
        [
            "--base-url", base_url, "--num-prompts", "8", "--max-concurrency", "4",
            "--random-input-len", "12", "--random-output-len", "5", "--seed", "3",
            "--goodput", "ttft:1000", "tpot:1000", "--result-file", str(out),
        ]
    )  # fmt: skip
    assert summary["model"] == "scripted"
    assert summary["completed"] == 8 and summary["failed"] == 0
    # The recorded line says how to run it again.
    assert summary["command"].startswith(f"python -m bench.serve --base-url {base_url} ")
    assert summary["total_input_tokens"] == 8 * 12
    assert summary["total_output_tokens"] == 8 * TOKENS
    assert FIRST_DELAY_S * 1000 <= summary["p50_ttft_ms"] < FIRST_DELAY_S * 1000 + 100
    assert GAP_S * 1000 <= summary["p50_itl_ms"] < GAP_S * 1000 + 50
    assert GAP_S * 1000 <= summary["mean_tpot_ms"] < GAP_S * 1000 + 50
    assert summary["p99_e2el_ms"] >= summary["p50_e2el_ms"] >= summary["p50_ttft_ms"]
    assert summary["goodput"] == summary["request_throughput"]
    slowest = summary["slowest_ttft_ms_at_s"]  # [first token ms, sent at s into the run]
    ttfts = [ms for ms, _ in slowest]
    assert len(slowest) == 5 and ttfts == sorted(ttfts, reverse=True)
    assert ttfts[0] >= summary["p50_ttft_ms"] - 0.1 and ttfts[-1] >= FIRST_DELAY_S * 1000
    assert all(0 <= at <= summary["duration_s"] for _, at in slowest)

    assert json.loads(out.read_text()) == summary


def test_one_client_at_a_time_keeps_its_connection(base_url):
    # A new connection for every request would add its set-up to each first token.
    CLIENT_PORTS.clear()
    summary = bench.main(
        [
            "--base-url", base_url, "--num-prompts", "6", "--max-concurrency", "1",
            "--random-input-len", "4", "--random-output-len", "5",
        ]
    )  # fmt: skip
    assert summary["completed"] == 6
    assert len(CLIENT_PORTS) == 6 and len(set(CLIENT_PORTS)) == 1


def test_headers_and_the_api_key_go_with_every_request(base_url):
    HEADERS.clear()
    summary = bench.main(
        [
            "--base-url", base_url, "--num-prompts", "3", "--random-input-len", "4",
            "--random-output-len", "5", "--header", "X-Tenant-Id=acme",
            "--header", "X-Request-Disconnect-Disabled=?1", "--api-key", "k1",
        ]
    )  # fmt: skip
    assert summary["completed"] == 3 and len(HEADERS) == 3
    for headers in HEADERS:
        assert headers["X-Tenant-Id"] == "acme"
        assert headers["X-Request-Disconnect-Disabled"] == "?1"
        assert headers["Authorization"] == "Bearer k1"


def test_a_header_without_a_value_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--header", "X-Tenant-Id"])
    assert "a header is NAME=VALUE, got 'X-Tenant-Id'" in capsys.readouterr().err


def test_slo_misses_lower_goodput_and_failures_are_counted(base_url):
    summary = bench.main(
        [
            "--base-url", base_url, "--num-prompts", "4", "--request-rate", "50",
            "--random-input-len", "4", "--random-output-len", "200", "--random-range-ratio", "0.5",
            "--goodput", "ttft:1",
        ]
    )  # fmt: skip
    # Output lengths 100..300: the scripted server rejects those over 100.
    assert summary["failed"] >= 1 and "too long" in summary["first_error"]
    assert summary["goodput"] == 0


def test_requests_are_deterministic_in_the_seed():
    args = bench.build_parser().parse_args(
        ["--num-prompts", "3", "--random-input-len", "6", "--seed", "7"]
    )
    assert bench.make_requests(args, None) == bench.make_requests(args, None)
    other = bench.build_parser().parse_args(
        ["--num-prompts", "3", "--random-input-len", "6", "--seed", "8"]
    )
    assert bench.make_requests(args, None) != bench.make_requests(other, None)
    assert all(len(prompt) == 6 for prompt, _, _ in bench.make_requests(args, None))


def test_in_process_runs_the_same_workload_on_the_engine():
    summary = bench.main(
        [
            "--in-process", "tiny-llama", "--engine-arg", "load_format=dummy",
            "--engine-arg", "max_model_len=128", "--engine-arg", "num_gpu_blocks=64",
            "--vocab-size", "1000", "--num-prompts", "6", "--max-concurrency", "3",
            "--random-input-len", "12", "--random-output-len", "9", "--ignore-eos",
        ]
    )  # fmt: skip
    assert summary["base_url"] == "in-process" and summary["model"] == "tiny-llama"
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_input_tokens"] == 6 * 12
    assert summary["total_output_tokens"] == 6 * 9
    # Every token after the first arrives as its own chunk (one step each).
    assert 0 < summary["mean_ttft_ms"] <= summary["mean_e2el_ms"]
    assert summary["mean_itl_ms"] > 0


def test_paired_run_sends_every_prompt_both_ways_and_reports_the_difference(base_url):
    PROMPT_LENS.clear()
    summary = bench.main(
        [
            "--base-url", base_url, "--paired-in-process", "tiny-llama",
            "--engine-arg", "load_format=dummy", "--engine-arg", "max_model_len=128",
            "--engine-arg", "num_gpu_blocks=64", "--vocab-size", "1000",
            "--num-prompts", "8", "--max-concurrency", "1", "--random-input-len", "12",
            "--random-output-len", "5", "--ignore-eos",
        ]
    )  # fmt: skip
    assert summary["base_url"] == base_url and summary["model"] == "scripted"
    assert summary["completed"] == 8 and summary["paired_requests"] == 8
    assert PROMPT_LENS == [12] * 8
    # The scripted server holds every first token FIRST_DELAY_S; the engine does not.
    assert summary["mean_ttft_ms"] >= FIRST_DELAY_S * 1000
    assert 0 < summary["in_process_mean_ttft_ms"] < summary["mean_ttft_ms"]
    added = summary["added_mean_ttft_ms"]
    assert added == pytest.approx(
        summary["mean_ttft_ms"] - summary["in_process_mean_ttft_ms"], abs=0.01
    )
    low, high = summary["added_mean_ttft_ci95_ms"]
    assert low <= added <= high


def test_paired_blocks_alternate_abba_and_report_the_steady_requests_apart(monkeypatch):
    """Blocks of 2: server-engine, engine-server, engine-server, server-engine; the second
    request of each block followed one of its own path, and only those make *_steady_*."""
    order = []

    def recording(path):
        async def send(*args):
            prompt = args[-3]
            order.append((path, prompt))
            result = bench.RequestResult(ok=True, prompt_len=1)
            result.ttft_s = 0.010
            return result

        return send

    monkeypatch.setattr(bench, "send", recording("server"))
    monkeypatch.setattr(bench, "send_in_process", recording("engine"))
    args = bench.build_parser().parse_args(
        ["--model", "m", "--max-concurrency", "1", "--paired-block", "2"]
    )
    requests = [(k, 1, 1) for k in range(8)]
    served, local, followed_own, _ = asyncio.run(bench.run_paired(args, requests, None))
    assert order == [
        ("server", 0), ("server", 1), ("engine", 0), ("engine", 1),
        ("engine", 2), ("engine", 3), ("server", 2), ("server", 3),
        ("engine", 4), ("engine", 5), ("server", 4), ("server", 5),
        ("server", 6), ("server", 7), ("engine", 6), ("engine", 7),
    ]  # fmt: skip
    assert followed_own == [False, True] * 4
    # The server adds 1 ms to a block's first request and 3 ms to the others.
    for k, result in enumerate(served):
        result.ttft_s += 0.003 if followed_own[k] else 0.001
    figures = bench.paired_difference(served, local, followed_own)
    assert figures["paired_requests"] == 8 and figures["paired_steady_requests"] == 4
    assert figures["added_mean_ttft_ms"] == pytest.approx(2.0)
    assert figures["added_mean_ttft_steady_ms"] == pytest.approx(3.0)
    assert figures["server_mean_ttft_steady_ms"] == pytest.approx(13.0)
    assert figures["added_mean_ttft_steady_ci95_ms"] == pytest.approx([3.0, 3.0])


def test_a_paired_run_is_one_request_at_a_time():
    with pytest.raises(SystemExit, match="--max-concurrency 1"):
        bench.main(["--paired-in-process", "tiny-llama", "--max-concurrency", "4"])
    with pytest.raises(SystemExit, match="not both"):
        bench.main(["--paired-in-process", "m", "--in-process", "m", "--max-concurrency", "1"])
    with pytest.raises(SystemExit, match="--paired-block"):
        bench.main(["--paired-in-process", "m", "--max-concurrency", "1", "--paired-block", "0"])


def test_engine_args_parse_as_json_where_they_can():
    assert bench.parse_engine_args(["a=1", "b=true", "c=dummy", "d=0.5"]) == {
        "a": 1,
        "b": True,
        "c": "dummy",
        "d": 0.5,
    }
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        bench.parse_engine_args(["oops"])


def test_word_tokenizer_round_trips_random_ids(tmp_path):
    from bench.word_tokenizer import write_word_tokenizer
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(write_word_tokenizer(tmp_path, vocab_size=1000))
    args = bench.build_parser().parse_args(["--num-prompts", "4", "--random-input-len", "50"])
    for prompt, prompt_len, _ in bench.make_requests(args, tokenizer):
        assert isinstance(prompt, str)
        assert len(tokenizer.encode(prompt, add_special_tokens=False)) == prompt_len == 50
    ids = list(range(0, 1000, 7))
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


def test_the_ingress_replicas_own_port_is_read_from_serves_log(tmp_path):
    from bench.serve_suite import _replica_http_port

    log = tmp_path / "serve.log"
    log.write_text("starting\n")
    assert _replica_http_port(log) is None
    log.write_text(
        "(ServeReplica:default:OpenAIIngress pid=1873) INFO default_OpenAIIngress pjaboz8h -- "
        "Allocated port 30000 for RequestProtocol.HTTP\n"
        "(ServeReplica:default:OpenAIIngress pid=2001) INFO default_OpenAIIngress q1 -- "
        "Allocated port 30001 for RequestProtocol.HTTP\n"
    )
    assert _replica_http_port(log) == 30001  # the latest replica
