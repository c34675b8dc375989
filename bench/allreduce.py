"""All-reduce latency inside CUDA graphs: NCCL against the peer-memory one-shot kernel.

    python -m bench.allreduce [--world-size 2] [--shared-devices]

Each rank runs in its own process that sees only its own GPU (as Ray places a replica's
workers); `--shared-devices` lets every process see every GPU instead. For each size a graph
of 32 back-to-back all-reduces is captured and replayed; the figure is the time per
all-reduce. The peer-memory result is checked against NCCL's on random data first.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cluster.topology import free_port

SIZES = [8 << 10, 64 << 10, 512 << 10, 1 << 20, 2 << 20, 8 << 20, 64 << 20]
CHAIN = 32
REPLAYS = 20


def time_in_graph(fn, x: torch.Tensor) -> float:
    """Microseconds per call of fn over a captured chain of CHAIN calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(CHAIN):
            y = fn(y)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * CHAIN)


def run_rank(rank: int, world_size: int, port: int, shared: bool, results) -> None:
    if not shared:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    device = torch.device("cuda", rank if shared else 0)
    torch.cuda.set_device(device)
    from engine import distributed as kd

    kd.init_distributed(world_size, 1, rank, backend="nccl", init_method=f"tcp://127.0.0.1:{port}")
    symmetric = kd.init_symmetric_all_reduce(device, max_bytes=max(SIZES))
    rows = []
    for nbytes in SIZES:
        numel = nbytes // 2
        torch.manual_seed(rank)
        x = torch.randn(numel, dtype=torch.bfloat16, device=device) / 64
        row = {"bytes": nbytes}

        def nccl(t):
            dist.all_reduce(t, group=kd._tp_group())
            return t

        row["nccl_us"] = round(time_in_graph(nccl, x.clone()), 2)
        if symmetric:
            expected = nccl(x.clone())
            got = kd._symmetric.all_reduce(x.clone())
            row["max_abs_diff"] = float((got.float() - expected.float()).abs().max())
            row["peer_us"] = round(time_in_graph(kd._symmetric.all_reduce, x.clone()), 2)
        rows.append(row)
    if rank == 0:
        results.put(
            {
                "bench": "allreduce",
                "gpu": torch.cuda.get_device_name(device),
                "world_size": world_size,
                "shared_devices": shared,
                "peer_memory": symmetric,
                "rows": rows,
            }
        )
    kd.destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--shared-devices", action="store_true")
    args = parser.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(
        run_rank,
        args=(args.world_size, port, args.shared_devices, results),
        nprocs=args.world_size,
        start_method="spawn",
    )
    out = results.get(timeout=10)
    print(json.dumps(out))
    print(f"{'bytes':>10} {'NCCL us':>9} {'peer us':>9} {'max diff':>9}")
    for r in out["rows"]:
        print(
            f"{r['bytes']:>10} {r['nccl_us']:>9} {r.get('peer_us', '-'):>9} "
            f"{r.get('max_abs_diff', '-'):>9}"
        )


if __name__ == "__main__":
    main()
