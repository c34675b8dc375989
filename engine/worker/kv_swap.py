"""One rank's CPU pool of KV blocks (swap_space) and the copies between it and the KV cache.

The pool is a tensor per attention layer in the cache's layout, [2, num_cpu_blocks,
block_size, kv heads, head dim], pinned on a CUDA rank; the scheduler names its blocks
(engine/core/kv_offload.py) and every rank applies the same ids to its own shard.

A step's copies (`apply`), reads before writes:

- copies in (pool -> cache): on CUDA, the host-to-device part runs on a side stream into a
  staging buffer, so it overlaps the step still on the device; the scatter into the cache
  runs on the step's stream after an event, so the forward that reads those blocks waits for
  them, and nothing that step in flight still writes is overwritten early;
- copies out (cache -> pool): the gather runs on the step's stream before the forward (which
  may reuse the blocks), the device-to-host part on the side stream, overlapping the step.
  A later step's copies in run on the same side stream, after it.

On a CPU rank both are plain index_select / index_copy_ in that order. The pool's blocks are
copied in runs of consecutive ids (the scheduler hands them out lowest first).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from engine.forward_context import forward_context
from engine.layers.attention import attention_layers, bind_kv_caches
from engine.worker.host_staging import host_to_device
from engine.worker.kv_memory import profile_batch

logger = logging.getLogger(__name__)

BLOCK_DIM = 1
"""The block dimension of a layer's [2, blocks, block_size, heads, head_dim] tensor."""


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    # float8 lacks index_select / index_copy_ on some devices; bytes copy the same.
    return t.view(torch.uint8)


def cpu_pool_blocks(swap_space_gib: float, block_bytes: int) -> int:
    """Blocks of `block_bytes` (one block across this rank's layers) in swap_space GiB."""
    return int(swap_space_gib * 2**30) // block_bytes


def _runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first id, position in `ids`, length) of each run of consecutive ids, `ids` sorted."""
    runs: list[tuple[int, int, int]] = []
    for pos, block_id in enumerate(ids):
        if runs and runs[-1][0] + runs[-1][2] == block_id:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((block_id, pos, 1))
    return runs


class KVSwapSpace:
    def __init__(self, gpu_caches: Sequence[torch.Tensor], num_cpu_blocks: int):
        if not gpu_caches:
            raise ValueError("the KV cache has no layers to swap")
        self.device = gpu_caches[0].device
        self.is_cuda = self.device.type == "cuda"
        self.gpu_caches = [_bytes_view(c) for c in gpu_caches]
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_caches = [
            torch.zeros(
                [*c.shape[:BLOCK_DIM], num_cpu_blocks, *c.shape[BLOCK_DIM + 1 :]],
                dtype=torch.uint8,
                pin_memory=self.is_cuda,
            )
            for c in self.gpu_caches
        ]
        self.block_bytes = sum(c[:, 0].numel() for c in self.gpu_caches)
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        logger.info(
            "KV swap space: %d blocks, %.2f GiB of %s memory",
            num_cpu_blocks,
            num_cpu_blocks * self.block_bytes / 2**30,
            "pinned" if self.is_cuda else "CPU",
        )

    def apply(
        self, copies_out: Sequence[tuple[int, int]], copies_in: Sequence[tuple[int, int]]
    ) -> None:
        """Copy (gpu, cpu) pairs out and (cpu, gpu) pairs in, as the module doc orders them."""
        if not copies_out and not copies_in:
            return
        copies_in = sorted(copies_in)
        copies_out = sorted(copies_out, key=lambda pair: pair[1])
        if self.is_cuda:
            self._apply_cuda(copies_out, copies_in)
        else:
            self._apply_cpu(copies_out, copies_in)

    def _apply_cpu(self, copies_out, copies_in) -> None:
        in_cpu, in_gpu = _index_pair(copies_in, self.device)
        out_gpu, out_cpu = _index_pair(copies_out, self.device)
        for gpu, cpu in zip(self.gpu_caches, self.cpu_caches, strict=True):
            staged = cpu.index_select(BLOCK_DIM, in_cpu) if copies_in else None
            if copies_out:
                cpu.index_copy_(BLOCK_DIM, out_cpu, gpu.index_select(BLOCK_DIM, out_gpu))
            if staged is not None:
                gpu.index_copy_(BLOCK_DIM, in_gpu, staged)

    def _apply_cuda(self, copies_out, copies_in) -> None:
        main, side = torch.cuda.current_stream(self.device), self.stream
        staged: list[torch.Tensor] = []
        in_done = None
        if copies_in:
            in_runs = _runs([cpu for cpu, _ in copies_in])
            with torch.cuda.stream(side):
                for cpu in self.cpu_caches:
                    buf = torch.empty(
                        (cpu.shape[0], len(copies_in), *cpu.shape[2:]),
                        dtype=cpu.dtype,
                        device=self.device,
                    )
                    _copy_runs(buf, cpu, [(pos, first, n) for first, pos, n in in_runs])
                    staged.append(buf)
                in_done = torch.cuda.Event()
                in_done.record(side)
        if copies_out:
            out_gpu = self._device_index([g for g, _ in copies_out])
            gathered = [gpu.index_select(BLOCK_DIM, out_gpu) for gpu in self.gpu_caches]
            side.wait_stream(main)
            out_runs = _runs([cpu for _, cpu in copies_out])
            with torch.cuda.stream(side):
                for cpu, src in zip(self.cpu_caches, gathered, strict=True):
                    _copy_runs(cpu, src, out_runs)
            for t in gathered:
                t.record_stream(side)
        if copies_in:
            main.wait_event(in_done)
            in_gpu = self._device_index([g for _, g in copies_in])
            for gpu, buf in zip(self.gpu_caches, staged, strict=True):
                gpu.index_copy_(BLOCK_DIM, in_gpu, buf)
                buf.record_stream(main)

    def _device_index(self, ids: list[int]) -> torch.Tensor:
        # Through pinned memory: a plain torch.tensor(..., device=) would wait for the step
        # in flight.
        return host_to_device(torch.tensor(ids, dtype=torch.long), self.device)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def measure_copy_costs(self, num_gpu_blocks: int) -> tuple[float, float]:
        """(bytes per second of a many-block copy in, seconds of a one-block copy in): copies
        of the pool's zeros into blocks of the cache before it holds anything."""
        n = max(1, min(64, self.num_cpu_blocks, num_gpu_blocks - 1))

        def timed(pairs: list[tuple[int, int]]) -> float:
            self.apply([], pairs)  # warm: first launches, staging memory
            self._sync()
            start = time.perf_counter()
            self.apply([], pairs)
            self._sync()
            return time.perf_counter() - start

        one = timed([(0, 1)])
        many = timed([(i, i + 1) for i in range(n)])
        return n * self.block_bytes / max(many, 1e-9), one

    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def _copy_runs(dst: torch.Tensor, src: torch.Tensor, runs) -> None:
    """dst[:, d : d + n] = src[:, s : s + n] for each (d, s, n), one contiguous copy per run
    and key / value half (a strided copy between host and device would go through pageable
    memory, synchronously)."""
    for d, s, n in runs:
        for half in range(dst.shape[0]):
            dst[half, d : d + n].copy_(src[half, s : s + n], non_blocking=True)


def _index_pair(pairs: Sequence[tuple[int, int]], device: torch.device):
    if not pairs:
        return None, None
    first = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=device)
    second = torch.tensor([b for _, b in pairs], dtype=torch.long, device=device)
    return first, second


@torch.inference_mode()
def measure_prefill_tokens_per_s(
    model: torch.nn.Module, num_tokens: int, max_model_len: int, device: torch.device
) -> float:
    """Prompt tokens per second of this rank's forward over `num_tokens` tokens of whole
    prompts (attention without a cache), the second of two runs."""
    input_ids, positions, meta, _ = profile_batch(num_tokens, max_model_len, device)
    layers = attention_layers(model)
    caches = [layer.kv_cache for layer in layers]
    bind_kv_caches(model, [None] * len(layers))  # attention over the batch alone
    try:
        elapsed = 0.0
        for _ in range(2):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            with forward_context(meta):
                model(input_ids, positions, None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
    finally:
        bind_kv_caches(model, caches)
    return num_tokens / max(elapsed, 1e-9)


PREFILL_PROBE_TOKENS = {"cuda": 2048, "cpu": 128}
"""Tokens of the forward timed for preemption_mode="auto": on a GPU enough to fill the card
(its prefill rate, not its launch overhead), on a CPU few (it only has to decide the mode)."""


def create_swap_space(
    kv_caches: Sequence[torch.Tensor], swap_space_gib: float
) -> KVSwapSpace | None:
    """The rank's pool for swap_space GiB; None when swap_space is 0."""
    if swap_space_gib <= 0:
        return None
    block_bytes = sum(_bytes_view(c)[:, 0].numel() for c in kv_caches)
    num_blocks = cpu_pool_blocks(swap_space_gib, block_bytes)
    if num_blocks < 1:
        raise ValueError(
            f"swap_space={swap_space_gib} GiB holds no KV block of {block_bytes} bytes: "
            "raise swap_space or set it to 0"
        )
    return KVSwapSpace(kv_caches, num_blocks)


def swap_space_info(
    space: KVSwapSpace,
    block_size: int,
    num_gpu_blocks: int,
    measure: bool,
    model: torch.nn.Module | None,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> dict[str, float]:
    """What the scheduler needs of this rank's pool: its blocks and, with `measure`
    (preemption_mode="auto"), the rates of engine/core/kv_offload.py's SwapCostModel.
    `model` None (a later pipeline stage, which cannot run alone): no prefill rate."""
    info: dict[str, float] = {
        "num_cpu_blocks": space.num_cpu_blocks,
        "block_bytes": space.block_bytes,
    }
    if not measure:
        return info
    copy_bytes_per_s, one_block_s = space.measure_copy_costs(num_gpu_blocks)
    info |= {
        "copy_bytes_per_s": copy_bytes_per_s,
        # A swap copies out and back in: two fixed costs of a copy's launches and wait.
        "fixed_s": 2 * one_block_s,
        "kv_bytes_per_token": space.block_bytes / block_size,
    }
    if model is not None:
        num_tokens = min(max_num_batched_tokens, PREFILL_PROBE_TOKENS[space.device.type])
        info["prefill_tokens_per_s"] = measure_prefill_tokens_per_s(
            model, num_tokens, max_model_len, space.device
        )
    return info
