"""Steps that hold a prefill, with and without piecewise CUDA graphs, in one engine.

python -m bench.prefill_steps --model-shape llama3-8b --prefill-cuda-graph-tokens 2048

For each prompt length: the time to the first token of one prompt arriving alone, and of
one arriving while --running requests decode (a Poisson 16 req/s load of 1024/128 keeps
about that many running), with the longest gap between two steps' outputs meanwhile (what
the running requests see as their inter-token latency), and the host time that launching
the step with the prompt took (the runner's call, which returns once the step's kernels
are queued: what a slow host stretches). The engine captures the graphs
once; the two modes alternate arrival by arrival (the runner's graphs set aside and put
back), so both see the same machine. Medians over --repeats arrivals each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.common import add_engine_args, build_llm, emit, random_prompts
from engine import SamplingParams


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--input-lens", type=int, nargs="+", default=[8, 256, 1024, 2048])
    parser.add_argument("--running", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if not args.prefill_cuda_graph_tokens:
        raise SystemExit("give --prefill-cuda-graph-tokens: the graphs to compare against")

    llm, startup_s = build_llm(args)
    engine = llm.engine
    runner = engine.executor.worker.runner
    graphs = runner.piecewise_graphs
    if graphs is None:
        raise SystemExit("the engine captured no piecewise graphs (a CPU, or enforce_eager)")
    launches = _record_prefill_launches(runner)
    vocab = engine.vocab_size
    figures: dict[str, dict] = {}
    for length in args.input_lens:
        results: dict[str, dict[str, list[float]]] = {"graphs": {}, "eager": {}}
        for i in range(args.repeats + 1):  # the first round warms up
            for mode in ("graphs", "eager"):
                runner.piecewise_graphs = graphs if mode == "graphs" else None
                seed = args.seed + 1000 * length + 10 * i + (mode == "eager")
                prompt = random_prompts(1, length, vocab, seed)[0]
                launches.clear()
                alone = _first_token_ms(engine, prompt, [])
                launch_ms = max(launches)
                running = random_prompts(args.running, 64, vocab, seed + 5)
                busy, gap = _first_token_ms(engine, prompt[::-1], running)
                if i:
                    got = results[mode]
                    got.setdefault("ttft_alone_ms", []).append(alone[0])
                    got.setdefault("launch_alone_ms", []).append(launch_ms)
                    got.setdefault("ttft_beside_decodes_ms", []).append(busy)
                    got.setdefault("longest_step_ms", []).append(gap)
        runner.piecewise_graphs = graphs
        figures[str(length)] = {
            mode: {k: round(statistics.median(v), 2) for k, v in got.items()}
            for mode, got in results.items()
        }
        print(length, figures[str(length)], flush=True)

    result = {
        "bench": "prefill_steps",
        "engine": "kvray",
        "model_shape": args.model_shape or args.model,
        "prefill_cuda_graph_tokens": args.prefill_cuda_graph_tokens,
        "running": args.running,
        "repeats": args.repeats,
        "startup_s": round(startup_s, 1),
        "by_input_len": figures,
        "command": "python -m bench.prefill_steps " + " ".join(argv or sys.argv[1:]),
    }
    emit(result, args.record)
    return result


def _record_prefill_launches(runner) -> list[float]:
    """Host ms of each runner call that launched a step with a prefill, appended as they run."""
    launches: list[float] = []
    launch = runner.execute_model_async

    def timed(out):
        start = time.perf_counter()
        pending = launch(out)
        if any(n > 1 for n in out.num_scheduled_tokens.values()):
            launches.append((time.perf_counter() - start) * 1e3)
        return pending

    runner.execute_model_async = timed
    return launches


def _first_token_ms(engine, prompt: list[int], running: list[list[int]]):
    """(ms from adding `prompt` to its first token, longest ms between two steps' outputs
    meanwhile); `running` requests are decoding when it arrives."""
    decode = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    ids = [f"run-{i}-{time.monotonic_ns()}" for i in range(len(running))]
    for rid, p in zip(ids, running):
        engine.add_request(rid, p, decode)
    seen: set[str] = set()
    while len(seen) < len(ids):  # every running request past its prefill
        seen.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    rid = f"new-{time.monotonic_ns()}"
    start = last = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    gap = 0.0
    while True:
        outputs = engine.step()
        now = time.perf_counter()
        if outputs:
            gap, last = max(gap, now - last), now
        if any(o.request_id == rid for o in outputs):
            break
    ttft = (now - start) * 1e3
    if ids:
        engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    if engine.config.device == "cuda":
        torch.cuda.synchronize()
    return ttft, gap * 1e3


if __name__ == "__main__":
    main()
