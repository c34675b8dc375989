"""The Serve issue's online workloads: `serve run`, then the same loads in process.

    python -m bench.serve_suite --model llama3-8b --load-format dummy [--record]

Starts `serve run serve_app:build_app` with the engine keys given, waits for /health, and
runs bench/serve.py (random 1024 in / 128 out, EOS ignored, streaming) at concurrency 1,
Poisson 16 req/s over 500 prompts, 500 prompts at once, and concurrency 32 (twice). Then it
stops Serve and runs concurrency 1 and 32 against an engine in this process with the same seeds
(same prompts): the Serve + HTTP path's cost is the difference. Each run has its own seed
(a repeated seed repeats the prompts and rides the prefix cache). One JSON line per run.

Without --tokenizer, a word-level tokenizer of the model's vocabulary is written to a
temporary folder (bench/word_tokenizer.py), so prompts travel as text as a client's would.
--quick shrinks every load to a smoke test (a CPU run of a tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import serve as serve_bench
from cluster.app_config import ENGINE_KEYS

# (label, seed, bench/serve.py arguments); --quick scales the prompt counts and lengths.
SERVE_LOADS = [
    ("concurrency1", 11, ["--num-prompts", "30", "--max-concurrency", "1"]),
    ("poisson16", 21, ["--num-prompts", "500", "--request-rate", "16"]),
    # Its p99 ITL falls between the gap of one prefill and that of two, and a few more
    # close arrivals move it by milliseconds: a second seed shows how far.
    ("poisson16-repeat", 23, ["--num-prompts", "500", "--request-rate", "16"]),
    ("burst500", 22, ["--num-prompts", "500"]),
    ("concurrency32", 31, ["--num-prompts", "200", "--max-concurrency", "32"]),
    # Closed-loop requests of one length come back in waves, and where an arrival falls
    # against the engine's steps moves its first token by a step: a second run shows how
    # far two runs of the same load part.
    ("concurrency32-repeat", 32, ["--num-prompts", "200", "--max-concurrency", "32"]),
]
IN_PROCESS_LOADS = ["concurrency1", "concurrency32", "concurrency32-repeat"]
# --c1-paths: concurrency 1 again, in turns, along shorter paths into the same replica:
# straight to the ingress replica's own HTTP port (past HAProxy), and with Serve's
# per-request disconnect watcher off (a client header turns it off). Each its own seed.
# --c1-paired: concurrency 1 through Serve and in process in turns, prompt by prompt (or
# --c1-paired-block prompts a turn: eight turns each way).
C1_PAIRED_PROMPTS = 60
C1_PATHS = [  # (label, straight to the replica, headers)
    ("concurrency1-haproxy", False, {}),
    ("concurrency1-direct", True, {}),
    ("concurrency1-haproxy-nowatch", False, {"x-request-disconnect-disabled": "?1"}),
    ("concurrency1-direct-nowatch", True, {"x-request-disconnect-disabled": "?1"}),
]
C1_PATHS_ROUNDS = 2
SERVE_URL = "http://127.0.0.1:8000"  # `serve run` of an import path listens here


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--serve-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--only", nargs="*", default=None, help="load labels to run")
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument(
        "--in-process-only",
        action="store_true",
        help="no Serve: every selected load against the in-process engine (engine keys "
        "from --serve-arg), e.g. to compare engine settings under one load",
    )
    parser.add_argument(
        "--c1-paths",
        action="store_true",
        help="after the Serve loads, concurrency 1 past HAProxy and without Serve's "
        "disconnect watcher, in turns (where the Serve path's first-token time goes)",
    )
    parser.add_argument(
        "--c1-paired",
        action="store_true",
        help="after the Serve loads, concurrency 1 to Serve and to an engine in this process "
        "in turns, prompt by prompt (bench/serve.py --paired-in-process); both engines hold "
        "the GPU at once, so give --serve-arg gpu_memory_utilization=0.4",
    )
    parser.add_argument(
        "--c1-paired-direct",
        action="store_true",
        help="--c1-paired again, straight to the ingress replica's own HTTP port (past "
        "HAProxy): what HAProxy's hop adds",
    )
    parser.add_argument(
        "--c1-paired-block",
        type=int,
        default=1,
        metavar="N",
        help="--c1-paired's turns take N prompts each (bench/serve.py --paired-block): "
        "eight turns a path",
    )
    parser.add_argument(
        "--label-suffix",
        default="",
        help="appended to every run's label (a setting outside the app's keys, e.g. of the node)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny loads (a smoke test)")
    parser.add_argument("--ready-timeout-s", type=float, default=900)
    parser.add_argument("--record", action="store_true", help="append to bench/results.jsonl")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv

    workdir = Path(tempfile.mkdtemp(prefix="kvray-serve-suite-"))
    tokenizer = args.tokenizer or str(_word_tokenizer(args, workdir / "tokenizer"))
    engine_keys = {
        "model": args.model,
        "load_format": args.load_format,
        "tokenizer": tokenizer,
        "max_model_len": args.max_model_len,
    }
    loads = [load for load in SERVE_LOADS if args.only is None or load[0] in args.only]
    engine_args = [f"{k}={v}" for k, v in engine_keys.items() if k not in ("model", "tokenizer")]
    # The app's engine keys hold for the in-process engine too (its serving keys do not).
    own_keys = [item for item in args.serve_arg if item.split("=", 1)[0] in ENGINE_KEYS]
    engine_items = [arg for item in engine_args + own_keys for arg in ("--engine-arg", item)]
    if not args.in_process_only:
        _run_serve(args, engine_keys, loads, tokenizer, workdir, engine_items)
    if args.skip_in_process:
        return
    in_process = ["--in-process", args.model, *engine_items]
    suffix = "".join(f"+{item}" for item in own_keys)
    for label, seed, load_args in loads:
        if args.in_process_only or label in IN_PROCESS_LOADS:
            _run(args, f"{label}-in-process{suffix}", seed, load_args, tokenizer, in_process)


def _run_serve(
    args, engine_keys: dict, loads, tokenizer: str, workdir: Path, engine_items: list[str]
) -> None:
    server = _start_serve(engine_keys, args.serve_arg, workdir / "serve.log")
    try:
        _wait_ready(SERVE_URL, server, args.ready_timeout_s, workdir / "serve.log")
        # The app's extra keys travel in the label of each recorded run.
        suffix = "".join(f"+{item}" for item in args.serve_arg)
        for label, seed, load_args in loads:
            _run(args, label + suffix, seed, load_args, tokenizer, ["--base-url", SERVE_URL])
        if args.c1_paths:
            _run_c1_paths(args, tokenizer, workdir / "serve.log", suffix)
        if args.c1_paired:
            # The engine in this process shares the GPU with the replica's: give both
            # gpu_memory_utilization (e.g. 0.4) in --serve-arg.
            block = args.c1_paired_block
            label = "concurrency1-paired" + (f"-block{block}" if block > 1 else "")
            prompts = C1_PAIRED_PROMPTS if block == 1 else 8 * block
            load = ["--num-prompts", str(prompts), "--max-concurrency", "1"]
            load += ["--paired-block", str(block)]
            # Each run its own seed: prompts the replica has seen come from its prefix cache.
            urls = [("", SERVE_URL, 41)]
            port = _replica_http_port(workdir / "serve.log") if args.c1_paired_direct else None
            if port is not None:
                urls.append(("-direct", f"http://127.0.0.1:{port}", 42))
            for path, url, seed in urls:
                target = ["--base-url", url, "--paired-in-process", args.model, *engine_items]
                _run(args, label + path + suffix, seed, load, tokenizer, target)
    finally:
        _stop(server)


def _run_c1_paths(args, tokenizer: str, log: Path, suffix: str) -> None:
    port = _replica_http_port(log)
    load_args = next(load for label, _, load in SERVE_LOADS if label == "concurrency1")
    seed = 100
    for _ in range(C1_PATHS_ROUNDS):
        for label, direct, headers in C1_PATHS:
            if direct and port is None:
                continue
            url = f"http://127.0.0.1:{port}" if direct else SERVE_URL
            target = ["--base-url", url]
            for name, value in headers.items():
                target += ["--header", f"{name}={value}"]
            seed += 1
            _run(args, label + suffix, seed, load_args, tokenizer, target)


def _replica_http_port(log: Path) -> int | None:
    """The ingress replica's own HTTP port (Serve's direct ingress logs it), else None."""
    found = re.findall(
        r"Allocated port (\d+) for RequestProtocol.HTTP", log.read_text(errors="replace")
    )
    return int(found[-1]) if found else None


def _word_tokenizer(args: argparse.Namespace, folder: Path) -> Path:
    from bench.word_tokenizer import write_word_tokenizer
    from engine.worker.loader import load_hf_config, resolve_model_source

    hf_config = load_hf_config(resolve_model_source(args.model, args.load_format))
    return write_word_tokenizer(folder, hf_config.vocab_size)


def _run(args, label: str, seed: int, load_args: list[str], tokenizer: str, target: list[str]):
    input_len, output_len = args.input_len, args.output_len
    if args.quick:
        load_args = _shrunk(load_args)
        input_len, output_len = min(input_len, 32), min(output_len, 8)
    label += args.label_suffix
    argv = [
        *target,
        "--tokenizer", tokenizer,
        "--random-input-len", str(input_len),
        "--random-output-len", str(output_len),
        "--ignore-eos",
        "--seed", str(seed),
        "--label", label,
        *load_args,
    ]  # fmt: skip
    if args.record:
        argv.append("--record")
    # The suite's own command line reproduces the run (server included).
    serve_bench.main(argv, command="python -m bench.serve_suite " + shlex.join(args.argv))


def _shrunk(load_args: list[str]) -> list[str]:
    out = list(load_args)
    for i, item in enumerate(out[:-1]):
        if item in ("--num-prompts", "--max-concurrency"):
            out[i + 1] = str(max(1, min(int(out[i + 1]), 8)))
    return out


def _start_serve(engine_keys: dict, extra: list[str], log: Path) -> subprocess.Popen:
    serve = shutil.which("serve", path=str(Path(sys.executable).parent)) or shutil.which("serve")
    if serve is None:
        raise SystemExit("the `serve` command (ray[serve]) is not on PATH")
    keys = [f"{k}={v}" for k, v in engine_keys.items()] + list(extra)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    command = [serve, "run", "serve_app:build_app", *keys]
    print(json.dumps({"serve_command": " ".join(command)}), flush=True)
    # Its own session, so that stopping it reaches every process it started.
    return subprocess.Popen(
        command,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        start_new_session=True,
    )


def _wait_ready(base_url: str, server: subprocess.Popen, timeout_s: float, log: Path) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if server.poll() is not None:
            raise SystemExit(f"serve run exited ({server.returncode}):\n{_tail(log)}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as response:
                if response.status == 200:
                    ready = round(time.monotonic() - start, 1)
                    print(json.dumps({"serve_ready_s": ready}), flush=True)
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"serve run not healthy after {timeout_s:g} s:\n{_tail(log)}")


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    main()
