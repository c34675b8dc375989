"""How many KV blocks a rank's memory holds, and the KV tensors themselves.

On a GPU the runner runs one forward at the full token budget (`profile_batch`), and what
that peak leaves of gpu_memory_utilization x the card goes to KV (`num_gpu_blocks`).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

from engine.forward_context import AttentionMetadata
from engine.layers.attention import attention_layers

logger = logging.getLogger(__name__)

FP8_MIN_CAPABILITY = (8, 9)
"""Compute capability from which a GPU converts to and from float8 (Ada, Hopper)."""


def kv_cache_torch_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV tensors' dtype for the engine key kv_cache_dtype: "auto" the model's, "fp8"
    float8_e4m3fn (ValueError on a GPU without float8 conversions)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype != "fp8":
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise ValueError(
                f"kv_cache_dtype='fp8' needs a GPU of compute capability "
                f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or later; {name} has "
                f"{'.'.join(map(str, capability))}: use kv_cache_dtype='auto'"
            )
    return torch.float8_e4m3fn


def kv_block_bytes(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all of this rank's layers."""
    layers = attention_layers(model)
    first = layers[0]
    per_layer = 2 * block_size * first.num_kv_heads * first.head_dim
    return per_layer * len(layers) * torch.tensor([], dtype=dtype).element_size()


def allocate_kv_caches(
    model: torch.nn.Module,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, kv heads, head dim] tensor per attention layer.
    Logs the capacity: block 0 is the null block, the others hold tokens."""
    layers = attention_layers(model)
    logger.info(
        "KV cache: %s, %d tokens (%d blocks of %d), %.2f GiB",
        str(dtype).removeprefix("torch."),
        (num_blocks - 1) * block_size,
        num_blocks - 1,
        block_size,
        num_blocks * kv_block_bytes(model, block_size, dtype) / 2**30,
    )
    # float8 as zero bytes (+0.0) viewed: not every torch build fills float8 on every device.
    zeros_dtype = torch.uint8 if dtype == torch.float8_e4m3fn else dtype
    return [
        torch.zeros(
            2,
            num_blocks,
            block_size,
            layer.num_kv_heads,
            layer.head_dim,
            dtype=zeros_dtype,
            device=device,
        ).view(dtype)
        for layer in layers
    ]


def profile_batch(
    num_tokens: int, max_model_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """(input ids, positions, metadata, each request's last row) of `num_tokens` tokens of
    whole prompts, attended without a cache."""
    seq_len = min(num_tokens, max_model_len - 1)
    lens = [seq_len] * (num_tokens // seq_len)
    if num_tokens % seq_len:
        lens.append(num_tokens % seq_len)
    starts = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=device),
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    last_rows = starts[1:].long().to(device) - 1
    return input_ids, positions, meta, last_rows


def num_gpu_blocks(
    device: torch.device,
    profile_forward: Callable[[], None],
    block_bytes: int,
    gpu_memory_utilization: float,
    non_torch_at_start: int,
    max_num_batched_tokens: int,
) -> int:
    """Run `profile_forward`, then give what is left of the budget to KV.

    The budget (gpu_memory_utilization x the card) is this process's: memory other
    processes hold counts only if it leaves too little free for the budget.
    `non_torch_at_start`: `non_torch_bytes` when the model began loading.
    """
    gc.collect()  # an engine dropped in a reference cycle still holds its KV cache
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    # CUDA/NCCL memory outside torch's allocator that this process took since loading.
    non_torch = max(non_torch_bytes(device) - non_torch_at_start, 0)
    free, total = torch.cuda.mem_get_info(device)
    budget = total * gpu_memory_utilization
    available = budget - peak - non_torch
    num_blocks = int(available // block_bytes)
    if num_blocks < 2:
        raise ValueError(
            f"no memory left for the KV cache: the model and a {max_num_batched_tokens}"
            f"-token forward take {peak / 2**30:.1f} GiB of the "
            f"{budget / 2**30:.1f} GiB allowed by gpu_memory_utilization"
        )
    # The KV cache comes from free memory plus what the allocator holds unused.
    room = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if available > room:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} "
            f"asks for {budget / 2**30:.1f} GiB of the card, but other processes leave "
            f"room for only {room / 2**30:.1f} GiB of KV cache: lower gpu_memory_utilization"
        )
    return num_blocks


def non_torch_bytes(device: torch.device) -> int:
    """Device memory in use that torch's allocator did not hand out (all processes)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)
