"""Tile sizes, warps, stages and split counts of the attention kernels, and the functions
that apply them to a launch.

The constants were chosen with bench/kernels.py on an H200 (figures in
bench/NOTES-kernels.md); its sweeps set them here, and every launch reads them afresh.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

DECODE_BLOCK_N = 64
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
# Partitions shorter than this spend more on the merge than they win in parallelism.
DECODE_MIN_PARTITION = 512
DECODE_MAX_SPLITS = 64
# Groups of <= 2 query heads per kv head (qwen3-0.6b's 16/8) do little work per key tile:
# with a full wave and no split, wider tiles read the cache faster.
DECODE_BLOCK_N_FEW_HEADS = 128
# Decode programs resident per SM at the tile sizes above (registers and shared memory).
DECODE_PROGRAMS_PER_SM = 4
# (BLOCK_M rows = query tokens x group heads, BLOCK_N keys, warps, stages). float32 runs
# its dots on FMA units and spills at the 16-bit tile sizes.
PREFILL_CONFIG = (64, 64, 4, 3)
PREFILL_CONFIG_FP32 = (32, 16, 8, 2)


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Context partitions per (request, kv head): about one wave of programs in all.

    A wave is DECODE_PROGRAMS_PER_SM resident programs on every SM. A batch that already
    fills it gains nothing from splitting and pays for the merge; a few long requests
    split until they fill it.
    """
    wave = DECODE_PROGRAMS_PER_SM * num_sms
    programs = max(1, num_seqs * num_kv_heads)
    most = max(1, min(DECODE_MAX_SPLITS, triton.cdiv(max_seq_len, DECODE_MIN_PARTITION)))
    return max(1, min(most, (wave + programs // 2) // programs))


def decode_split_variants() -> list[int]:
    """A split count for each decode kernel variant: unsplit, then each power of two up to
    DECODE_MAX_SPLITS (the merge's tile over the partials, BLOCK_S, is the count's next
    power of two, a compile-time constant)."""
    return [1] + [1 << k for k in range(1, (DECODE_MAX_SPLITS - 1).bit_length() + 1)]


class DecodeTile(NamedTuple):
    block_g: int
    """Query rows per program: the kv head's group of query heads, padded for the dots."""
    block_n: int
    """Keys per step of the walk over the partition."""
    num_warps: int
    num_stages: int


def decode_tile(group: int, num_splits: int, float32: bool) -> DecodeTile:
    block_g = max(16, triton.next_power_of_2(group))
    block_n, num_warps = DECODE_BLOCK_N, DECODE_NUM_WARPS
    if block_g >= 32:
        # Many query rows per program (MQA-like groups): more warps, and float32 tiles
        # small enough not to spill.
        num_warps = 8
        block_n = 32 if float32 else block_n
    elif group <= 2 and num_splits == 1 and not float32:
        block_n = DECODE_BLOCK_N_FEW_HEADS
    return DecodeTile(block_g, block_n, num_warps, DECODE_NUM_STAGES)


def prefill_config(float32: bool) -> tuple[int, int, int, int]:
    """(largest BLOCK_M, BLOCK_N, warps, stages) of the prefill kernel."""
    return PREFILL_CONFIG_FP32 if float32 else PREFILL_CONFIG


def prefill_block_m(max_query_len: int, group: int, float32: bool) -> int:
    """Rows of a prefill tile (query tokens x the group's heads): small tiles when every
    query of the batch is short (decodes mixed with short chunks)."""
    max_m = prefill_config(float32)[0]
    block_m = max(16, min(max_m, triton.next_power_of_2(max_query_len * group)))
    return max(block_m, triton.next_power_of_2(group))


def prefill_tile_query_lens(group: int, float32: bool) -> list[int]:
    """The shortest longest-query (of 2 tokens or more) that takes each prefill tile size.
    Each size is a Triton compile of its own; a warm-up that runs a prefill of each of
    these lengths leaves none to compile while serving."""
    lens: dict[int, int] = {}
    largest = prefill_block_m(1 << 20, group, float32)
    length = 2
    while largest not in lens:
        lens.setdefault(prefill_block_m(length, group, float32), length)
        length += 1
    return sorted(lens.values())
