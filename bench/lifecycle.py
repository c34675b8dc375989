"""The model lifecycle on one GPU: a weights-only switch from disk and from the weight cache, a
whole-engine switch from the cache, sleep and wake, beside a cold start.

python -m bench.lifecycle --record                  (llama3-8b shape, bf16: a 16 GB checkpoint)
python -m bench.lifecycle --model-shape tiny-llama --max-model-len 256 --weight-cache-gb 1
                                                    (a tiny run that works on a CPU)

Dummy weights cannot be read from disk, so the bench first writes a safetensors checkpoint of
the shape (random weights, shards of --shard-gb) to --checkpoint-dir (a temporary folder by
default, removed at the end), and a second folder of hard links to the same files: another
model to the engine and the cache (another path), the same bytes on disk. Before each read
from disk the files are dropped from the page cache (posix_fadvise), so that "disk" reads
the disk.

Steps, each timed: a cold start of the engine from disk (A); putting A's weights in the weight
cache (a device-to-host copy into pinned memory); a weights-only switch to B from disk; back to
A from the cache; sleep level 1 (GPU memory after it: allocated, reserved, free); wake-up
(from the cache); sleep level 2 and its wake-up (from the cache); a whole-engine switch to B
(the engine rebuilt, B's weights from the cache). The greedy tokens of one prompt are checked
to be A's after every return to A.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import add_engine_args, emit, engine_kwargs
from engine import LLM, SamplingParams

PROMPT = list(range(1000, 1032))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_args(parser)
    parser.set_defaults(model_shape="llama3-8b")
    parser.add_argument("--weight-cache-gb", type=float, default=40.0)
    parser.add_argument(
        "--checkpoint-dir", default=None, help="where to write (default: a temp dir)"
    )
    parser.add_argument("--shard-gb", type=float, default=4.0)
    return parser.parse_args(argv)


def write_checkpoint(shape: str, folder: Path, dtype: torch.dtype, shard_bytes: int) -> int:
    """A safetensors checkpoint of the shape (N(0, 0.02) weights, norms at 1) in shards with
    their index; returns its bytes."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from engine.models.shapes import get_shape_config

    config = get_shape_config(shape)
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(config).state_dict()
    folder.mkdir(parents=True, exist_ok=True)
    name = str(dtype).removeprefix("torch.")
    fields = config.to_dict() | {"dtype": name, "torch_dtype": name}
    (folder / "config.json").write_text(json.dumps(fields))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(0)
    weight_map, shard, shard_size, total, index = {}, {}, 0, 0, 0

    def flush() -> None:
        nonlocal shard, shard_size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, folder / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, shard_size, index = {}, 0, index + 1

    for name, meta in shapes.items():
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        if "norm" in name:
            tensor = torch.ones(meta.shape, dtype=dtype)
        else:
            tensor = torch.empty(meta.shape, dtype=dtype, device=device)
            tensor = tensor.normal_(0.0, 0.02, generator=gen).cpu()
        size = tensor.numel() * tensor.element_size()
        if shard_size + size > shard_bytes:
            flush()
        shard[name] = tensor
        shard_size += size
        total += size
    flush()
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_doc))
    return total


def linked_copy(source: Path, folder: Path) -> None:
    """Another folder of the same files (hard links: no more disk)."""
    folder.mkdir()
    for file in source.iterdir():
        os.link(file, folder / file.name)


def drop_page_cache(folder: Path) -> None:
    for file in folder.iterdir():
        with file.open("rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return round(time.perf_counter() - start, 3)


def gpu_memory_gib() -> dict[str, float] | None:
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated": round(torch.cuda.memory_allocated() / 2**30, 2),
        "reserved": round(torch.cuda.memory_reserved() / 2**30, 2),
        "free": round(free / 2**30, 2),
        "total": round(total / 2**30, 2),
    }


def tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def run(args: argparse.Namespace, root: Path) -> dict:
    kwargs = engine_kwargs(args)
    shape = kwargs.pop("model")
    del kwargs["load_format"]
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    a, b = root / "a", root / "b"
    start = time.perf_counter()
    checkpoint_bytes = write_checkpoint(shape, a, dtype, int(args.shard_gb * 2**30))
    linked_copy(a, b)
    write_s = round(time.perf_counter() - start, 1)

    drop_page_cache(a)
    result: dict = {"checkpoint_gib": round(checkpoint_bytes / 2**30, 2), "write_s": write_s}
    start = time.perf_counter()
    llm = LLM(str(a), weight_cache_gb=args.weight_cache_gb, **kwargs)
    _sync()
    result["cold_start_s"] = round(time.perf_counter() - start, 3)
    want = tokens(llm)
    engine = llm.engine
    result["cache_put_s"] = timed(
        lambda: engine.executor.collective_rpc("lifecycle", "keep_in_cache")
    )
    drop_page_cache(b)
    result["switch_weights_disk_s"] = timed(lambda: llm.load_model(str(b), weights_only=True))
    result["switch_weights_cache_s"] = timed(lambda: llm.load_model(str(a), weights_only=True))
    assert tokens(llm) == want, "tokens after switching back from the cache"
    result["memory_awake_gib"] = gpu_memory_gib()
    result["sleep_1_s"] = timed(lambda: llm.sleep(1))
    result["memory_asleep_1_gib"] = gpu_memory_gib()
    result["wake_1_cache_s"] = timed(llm.wake_up)
    assert tokens(llm) == want, "tokens after sleep level 1"
    result["sleep_2_s"] = timed(lambda: llm.sleep(2))
    result["memory_asleep_2_gib"] = gpu_memory_gib()
    result["wake_2_cache_s"] = timed(llm.wake_up)
    assert tokens(llm) == want, "tokens after sleep level 2"
    result["switch_engine_cache_s"] = timed(lambda: llm.load_model(str(b)))
    assert tokens(llm) == want, "tokens of B (A's bytes) after a whole switch"
    llm.engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    own = args.checkpoint_dir is not None
    root = Path(args.checkpoint_dir) if own else Path(tempfile.mkdtemp(prefix="kvray-lifecycle-"))
    try:
        result = run(args, root / "lifecycle-bench" if own else root)
    finally:
        shutil.rmtree(root / "lifecycle-bench" if own else root, ignore_errors=True)
    emit(
        {
            "bench": "lifecycle",
            "model_shape": args.model_shape,
            "weight_cache_gb": args.weight_cache_gb,
            **result,
            "command": "python -m bench.lifecycle "
            + " ".join(sys.argv[1:] if argv is None else argv),
        },
        args.record,
    )


if __name__ == "__main__":
    main()
