"""Shared pieces of the offline benchmarks: engine set-up, roofline, results on record."""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from pathlib import Path

import torch

import kvray_env

RESULTS = Path(__file__).with_name("results.jsonl")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-shape", default=None, help="named shape with dummy weights")
    parser.add_argument("--model", default=None, help="HF folder or .gguf with real weights")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--quantization", default="auto", help="engine key: auto, none, fp8, awq, gptq, gguf"
    )
    parser.add_argument("--kv-cache-dtype", default="auto", help="engine key: auto or fp8")
    # None: the engine's defaults for the GPU (engine/config.py default_batch_limits).
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument(
        "--sequence-parallel-min-tokens",
        type=int,
        default=None,
        help="tensor parallel: batches of at least this many tokens run sequence-parallel "
        "(0: never; default: the engine's)",
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--prefill-cuda-graph-tokens",
        type=int,
        default=None,
        help="steps with prefills of up to this many tokens replay piecewise CUDA graphs",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--baseline", choices=["hf"], default=None)
    parser.add_argument("--record", action="store_true", help=f"append the result to {RESULTS}")
    parser.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    if (args.model is None) == (args.model_shape is None):
        raise SystemExit("give exactly one of --model-shape or --model")
    kwargs = dict(
        model=args.model or args.model_shape,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        quantization=args.quantization,
    )
    if args.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    for key in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "sequence_parallel_min_tokens",
        "prefill_cuda_graph_tokens",
    ):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    if args.model_shape:
        kwargs["load_format"] = "dummy"
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        from cluster.executor import RayActorGroupExecutor

        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
        kwargs["pipeline_parallel_size"] = args.pipeline_parallel_size
        kwargs["distributed_executor_backend"] = RayActorGroupExecutor
    return kwargs


def build_llm(args: argparse.Namespace):
    from engine import LLM

    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    if llm.engine.config.device == "cuda":
        torch.cuda.synchronize()
    return llm, time.perf_counter() - start


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab_size, 100000), (num, length), generator=gen).tolist()


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth, bytes read plus written, median of 20 copies of 4 GiB."""
    n = 1 << 31
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    t = sorted(times[3:])[len(times[3:]) // 2]
    return 2 * n * 2 / t / 1e9


def hf_model_for(args: argparse.Namespace, dtype: torch.dtype):
    """The same shape through transformers, random weights on the GPU."""
    from transformers import AutoModelForCausalLM

    from engine.models.shapes import get_shape_config

    config = get_shape_config(args.model_shape)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def git_commit() -> str:
    if commit := kvray_env.commit():
        return commit
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], text=True, cwd=Path(__file__).parent
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def read_setting(path: str) -> str:
    """A /sys or /proc file's text, "absent" where the machine has none."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "absent"


def emit(result: dict, record: bool) -> None:
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu_name(),
        "commit": git_commit(),
        **result,
    }
    line = json.dumps(result)
    print(line, flush=True)
    if record:
        with RESULTS.open("a") as f:
            f.write(line + "\n")
