"""Where one engine step's time goes: wall time per phase, and the GPU time of the forward.

python -m bench.profile_step --model-shape llama3-8b --batch-size 1 --context 256
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from bench.common import add_engine_args, build_llm, random_prompts
from engine import SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    llm, _ = build_llm(args)
    engine = llm.engine
    runner = engine.executor.worker.runner
    phases: dict[str, list[float]] = defaultdict(list)

    def timed(name, fn):
        def wrapper(*a, **k):
            torch.cuda.synchronize()
            t = time.perf_counter()
            r = fn(*a, **k)
            torch.cuda.synchronize()
            phases[name].append(time.perf_counter() - t)
            return r

        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.scheduler.update_from_output = timed("update", engine.scheduler.update_from_output)
    runner.prepare_inputs = timed("prepare_inputs", runner.prepare_inputs)
    runner.execute_model = timed("execute_model", runner.execute_model)
    if runner.cuda_graphs:
        runner.cuda_graphs.run = timed("graph_run", runner.cuda_graphs.run)
    runner.model.compute_logits = timed("compute_logits", runner.model.compute_logits)
    import engine.model_runner as mr

    mr.sample = timed("sample", mr.sample)
    mr.build_sampling_batch = timed("build_sampling_batch", mr.build_sampling_batch)

    for bs in args.batch_size:
        prompts = random_prompts(bs, args.context, engine.vocab_size, 0)
        params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"warm{bs}-{i}", p, params)
        while engine.has_unfinished_requests():
            engine.step()
        for i, p in enumerate(prompts):
            engine.add_request(f"r{bs}-{i}", p, params)
        engine.step()  # prefill
        phases.clear()
        steps = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        med = sorted(steps)[len(steps) // 2]
        print(
            f"batch {bs}: engine.step median {med * 1e3:.3f} ms over {len(steps)} steps (synced phases)"
        )
        for name, ts in phases.items():
            ts = sorted(ts)
            print(f"  {name:22s} median {ts[len(ts) // 2] * 1e3:8.3f} ms  n={len(ts)}")
    # GPU time of one graph replay.
    if runner.cuda_graphs:
        for bs in runner.cuda_graphs.sizes[:1] + [64]:
            if bs not in runner.cuda_graphs.graphs:
                continue
            g = runner.cuda_graphs.graphs[bs]
            for _ in range(5):
                g.replay()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(50):
                g.replay()
            b.record()
            b.synchronize()
            print(f"graph replay bs={bs}: {a.elapsed_time(b) / 50:.3f} ms GPU")


def kernel_table(argv: list[str] | None = None) -> None:
    """torch.profiler over eager decode forwards: GPU time per kernel."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(argv)
    args.enforce_eager = True
    llm, _ = build_llm(args)
    engine = llm.engine
    prompts = random_prompts(1, 256, engine.vocab_size, 0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate(prompts, params)
    engine.add_request("p", prompts[0], params)
    engine.step()
    for _ in range(3):
        engine.step()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    )


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["kernels"]:
        kernel_table(sys.argv[2:])
    else:
        main()
