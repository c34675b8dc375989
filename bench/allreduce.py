"""All-reduce latency inside CUDA graphs: NCCL against the peer-memory one-shot kernel.

    python -m bench.allreduce [--world-size 2] [--shared-devices]
    python -m bench.allreduce --large      (eager, the sizes of prefill steps)

Each rank runs in its own process that sees only its own GPU (as Ray places a replica's
workers); `--shared-devices` lets every process see every GPU instead. For each size a graph
of 32 back-to-back all-reduces is captured and replayed; the figure is the time per
all-reduce. The peer-memory result is checked against NCCL's on random data first.

`--large` times eager all-reduces of 16-128 MiB (a 16K-token prefill step's hidden states
at 4096 features is 128 MiB): NCCL against torch's two-shot peer-memory kernel (each rank
sums its half from both buffers, then copies the peer's half), the input copied into the
symmetric buffer first as the model would have to. NCCL_* variables set for the command
reach NCCL.
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
LARGE_SIZES = [16 << 20, 64 << 20, 128 << 20]
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


def time_eager(fn, x: torch.Tensor, calls: int = 20) -> float:
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def large_rows(device: torch.device) -> list[dict]:
    import torch.distributed._symmetric_memory as symm_mem

    from engine import distributed as kd

    group = kd.get_tp_group()
    buffer = symm_mem.empty(max(LARGE_SIZES), dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buffer, group.group_name)
    rows = []
    for nbytes in LARGE_SIZES:
        torch.manual_seed(dist.get_rank())
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device) / 64
        staging = buffer[:nbytes].view(torch.bfloat16)
        out = torch.empty_like(x)

        def nccl(t):
            dist.all_reduce(t, group=group)
            return t

        def two_shot(t, staging=staging, out=out):
            staging.copy_(t)
            return torch.ops.symm_mem.two_shot_all_reduce_out(staging, "sum", group.group_name, out)

        expected = nccl(x.clone())
        got = two_shot(x)
        row = {"bytes": nbytes, "max_abs_diff": float((got.float() - expected.float()).abs().max())}
        row["nccl_us"] = round(time_eager(nccl, x.clone()), 1)
        row["two_shot_us"] = round(time_eager(two_shot, x), 1)
        row["nccl_gbs"] = round(nbytes / row["nccl_us"] / 1e3, 1)
        rows.append(row)
    return rows


def run_rank(
    rank: int, world_size: int, port: int, shared: bool, results, large: bool = False
) -> None:
    if not shared:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    device = torch.device("cuda", rank if shared else 0)
    torch.cuda.set_device(device)
    from engine import distributed as kd

    kd.init_distributed(world_size, 1, rank, backend="nccl", init_method=f"tcp://127.0.0.1:{port}")
    if large:
        rows = large_rows(device)
        if rank == 0:
            nccl_env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
            results.put({"bench": "allreduce_large", "nccl_env": nccl_env, "rows": rows})
        kd.destroy_distributed()
        return
    symmetric = kd.init_symmetric_all_reduce(device, max_bytes=max(SIZES))
    rows = []
    for nbytes in SIZES:
        numel = nbytes // 2
        torch.manual_seed(rank)
        x = torch.randn(numel, dtype=torch.bfloat16, device=device) / 64
        row = {"bytes": nbytes}

        def nccl(t):
            dist.all_reduce(t, group=kd.get_tp_group())
            return t

        row["nccl_us"] = round(time_in_graph(nccl, x.clone()), 2)
        if symmetric:
            peer = kd.get_symmetric_all_reduce()
            expected = nccl(x.clone())
            got = peer.all_reduce(x.clone())
            row["max_abs_diff"] = float((got.float() - expected.float()).abs().max())
            row["peer_us"] = round(time_in_graph(peer.all_reduce, x.clone()), 2)
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
    parser.add_argument("--large", action="store_true", help="eager, 16-128 MiB")
    args = parser.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(
        run_rank,
        args=(args.world_size, port, args.shared_devices or args.large, results, args.large),
        nprocs=args.world_size,
        start_method="spawn",
    )
    out = results.get(timeout=10)
    print(json.dumps(out))
    if args.large:
        return
    print(f"{'bytes':>10} {'NCCL us':>9} {'peer us':>9} {'max diff':>9}")
    for r in out["rows"]:
        print(
            f"{r['bytes']:>10} {r['nccl_us']:>9} {r.get('peer_us', '-'):>9} "
            f"{r.get('max_abs_diff', '-'):>9}"
        )


if __name__ == "__main__":
    main()
