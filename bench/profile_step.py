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
    runner.execute_model_async = timed("execute_model_async", runner.execute_model_async)
    if runner.cuda_graphs:
        runner.cuda_graphs.run = timed("graph_run", runner.cuda_graphs.run)
    runner.model.compute_logits = timed("compute_logits", runner.model.compute_logits)
    import engine.worker.model_runner as mr
    import engine.worker.sampled_tokens as st

    mr.sample_on_device = timed("sample_on_device", mr.sample_on_device)
    st.finish_sampling = timed("finish_sampling", st.finish_sampling)
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def workload_profile(argv: list[str] | None = None) -> None:
    """A suite workload step by step: where its wall time goes, then GPU time per kernel over
    a window of decode steps in the middle of the run (CUDA graphs on, as measured).

    python -m bench.profile_step workload --model-shape qwen3-0.6b --workload mixed
    """
    from bench.suite import WORKLOADS, workload_requests

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--window", type=int, default=20, help="decode steps under the profiler")
    args = parser.parse_args(argv)
    llm, _ = build_llm(args)
    engine = llm.engine
    ((_, n, inp, out),) = [w for w in WORKLOADS[args.model_shape] if w[0] == args.workload]
    prompts, params = workload_requests(args.workload, n, inp, out, engine.vocab_size, args.seed)
    if not isinstance(params, list):
        params = [params] * len(prompts)
    scheduled: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule(*a, **k):
        so = schedule(*a, **k)
        scheduled.append((so.total_num_scheduled_tokens, len(so.num_scheduled_tokens)))
        return so

    engine.scheduler.schedule = recording_schedule

    def run(profile_from: int | None = None):
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"w{len(scheduled)}-{i}", p, sp)
        steps, prof, num_out = [], None, 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            if profile_from is not None and len(steps) == profile_from:
                from torch.profiler import ProfilerActivity, profile

                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                prof.__enter__()
            t = time.perf_counter()
            for o in engine.step():
                num_out += len(o.outputs[0].token_ids) if o.finished else 0
            steps.append(time.perf_counter() - t)
            if prof is not None and len(steps) == profile_from + args.window:
                _sync()
                prof.__exit__(None, None, None)
        _sync()
        return time.perf_counter() - start, steps, prof, num_out

    scheduled.clear()
    wall, steps, _, num_out = run()
    sched = scheduled[: len(steps)]
    print(f"{args.workload}: {wall:.2f} s, {num_out / wall:.0f} output tok/s, {len(steps)} steps")
    prefill = [(t, s) for t, s in zip(steps, sched, strict=True) if s[0] > s[1]]
    decode = [(t, s) for t, s in zip(steps, sched, strict=True) if s[0] == s[1] > 0]
    other = len(steps) - len(prefill) - len(decode)
    print(
        f"  steps with prefill tokens: {len(prefill)}, {sum(t for t, _ in prefill):.2f} s, "
        f"{sum(s[0] for _, s in prefill)} tokens; empty steps: {other}"
    )
    print(f"  decode-only steps: {len(decode)}, {sum(t for t, _ in decode):.2f} s")
    for lo in range(0, max((s[1] for _, s in decode), default=0) + 1, 32):
        group = [t for t, s in decode if lo < s[1] <= lo + 32]
        if group:
            group.sort()
            print(
                f"    batch {lo + 1:4d}-{lo + 32:4d}: {len(group):5d} steps, "
                f"median {group[len(group) // 2] * 1e3:7.3f} ms, sum {sum(group):6.2f} s"
            )
    # The same run again, profiled over a window of decode steps in its middle.
    middle = next((i for i, s in enumerate(sched) if s[0] == s[1] and i > len(sched) // 3), 0)
    scheduled.clear()
    _, steps, prof, _ = run(profile_from=middle)
    window = scheduled[middle : middle + args.window]
    wall_ms = sum(steps[middle : middle + args.window]) * 1e3
    print(
        f"profiled steps {middle}..{middle + args.window}: {wall_ms:.2f} ms wall, "
        f"batch {window[0][1] if window else 0}..{window[-1][1] if window else 0}"
    )
    if prof is not None:
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=30, max_name_column_width=70
            )
        )
        print(
            prof.key_averages().table(
                sort_by="cpu_time_total", row_limit=20, max_name_column_width=70
            )
        )


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["kernels"]:
        kernel_table(sys.argv[2:])
    elif sys.argv[1:2] == ["workload"]:
        workload_profile(sys.argv[2:])
    else:
        main()
