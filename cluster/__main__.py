"""`python -m cluster start-head | start-worker --address HOST:PORT | local --workers N`.

start-head / start-worker wrap `ray start` (their extra arguments go to it unchanged);
local runs a head plus N worker raylets on this machine until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading

from cluster.topology import (
    DEFAULT_GCS_PORT,
    DEFAULT_METRICS_PORT,
    LocalCluster,
    node_env,
    ray_start_command,
)


def _node_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-cpus", type=int, default=None, help="default: all cores")
    parser.add_argument("--num-gpus", type=int, default=None, help="default: all GPUs")
    parser.add_argument(
        "--resources", type=json.loads, default=None, help='custom resources as JSON: {"a": 1}'
    )
    parser.add_argument(
        "--metrics-export-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"Prometheus metrics of this node (default: {DEFAULT_METRICS_PORT})",
    )
    parser.add_argument("--block", action="store_true", help="stay in the foreground")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cluster", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    head = commands.add_parser("start-head", help="start this machine as the Ray head node")
    head.add_argument("--port", type=int, default=DEFAULT_GCS_PORT, help="GCS port")
    head.add_argument("--dashboard", action="store_true", help="also run the Ray dashboard")
    _node_args(head)
    worker = commands.add_parser("start-worker", help="join this machine to a head node")
    worker.add_argument("--address", required=True, help="the head's HOST:PORT")
    _node_args(worker)
    local = commands.add_parser("local", help="a head and N worker raylets on this machine")
    local.add_argument("--workers", type=int, default=1, help="worker nodes (default 1)")
    local.add_argument("--num-cpus", type=int, default=1, help="CPUs per node (default 1)")
    local.add_argument("--port", type=int, default=None, help="GCS port (default: a free one)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if args.command == "local":
        if extra:
            raise SystemExit(f"unknown arguments: {' '.join(extra)}")
        return _run_local(args)
    head = args.command == "start-head"
    cmd = ray_start_command(
        head=head,
        address=None if head else args.address,
        port=args.port if head else DEFAULT_GCS_PORT,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        resources=args.resources,
        metrics_export_port=args.metrics_export_port,
        dashboard=head and args.dashboard,
        block=args.block,
    )
    return subprocess.call(cmd + extra, env=node_env())


def _run_local(args: argparse.Namespace) -> int:
    if args.workers < 0:
        raise SystemExit(f"--workers must be >= 0, got {args.workers}")
    cluster = LocalCluster(num_workers=args.workers, num_cpus=args.num_cpus, port=args.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster.start()
    try:
        print(
            f"kvray local cluster: head + {args.workers} worker node(s) at {cluster.address}\n"
            f"  RAY_ADDRESS={cluster.address} RAY_AUTH_MODE=disabled python your_driver.py\n"
            "Ctrl-C stops it.",
            flush=True,
        )
        stop.wait()
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
