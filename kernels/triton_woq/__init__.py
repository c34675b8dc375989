"""Triton WOQ linear layers: `woq_linear` multiplies by a weight in the layout of
kernels/woq_ref.py (4 or 8 bits, groups of 16 to 128), read as it is: no repacking.

Three paths, picked on the host from the number of rows M of x (a Python int, so a CUDA
graph captures one of them):
- M == 1: the GEMV (gemv.py), CUDA cores, the weights dequantized in registers.
- 1 < M < DEQUANT_MIN_M: the tensor-core GEMM (gemm.py), dequantized tile by tile.
- M >= DEQUANT_MIN_M: the weight dequantized once in x's dtype, then cuBLAS. A fused tile
  is dequantized once per row block of x, and Triton's GEMM reaches a smaller share of the
  tensor cores than cuBLAS; past about a thousand rows the GEMM's compute outweighs the
  dequantization's extra traffic (2.5 bytes a weight).
Every path is one Triton launch (plus cuBLAS for the last), with no host syncs; split-K
programs merge through counters kept zero between launches (common.split_counters).
Activations are float16 or bfloat16; the products are summed in float32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from kernels.pdl import pdl_launch
from kernels.triton_woq.common import MAGIC_HI, MAGIC_LO, split_counters
from kernels.triton_woq.gemm import woq_dequant_kernel, woq_gemm_kernel
from kernels.triton_woq.gemv import woq_gemv_kernel
from kernels.woq_ref import check_woq

DEQUANT_MIN_M = 1024
# Split K until a launch has about this many programs a SM: the GEMV's are short (a few
# tiles each); a GEMM program holds more work and more registers.
GEMV_PROGRAMS_PER_SM = 4
GEMM_PROGRAMS_PER_SM = 2
# A GEMV tile holds at least one chunk a thread (block_c >= 32 * num_warps): with fewer,
# a chunk's inputs of x span several threads, and Triton 3.6 compiles the sum of x over
# each piece (gemv._tile_dot) into shuffles across the wrong lanes, adding other chunks'
# inputs (seen in the PTX for sm_90; the interpreter computes it right).
MIN_CHUNKS_A_WARP = 32
DEQUANT_TILE = (32, 128)  # (rows, inputs) of a woq_dequant_kernel program


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # rows a program
    block_c: int  # chunks (16 bytes of a row: 128 // bits inputs) a tile; 32 a warp
    num_warps: int
    split: int  # programs along K per row block


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows of x a program
    block_n: int  # output features a program
    block_k: int
    num_warps: int
    num_stages: int
    split: int


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    return _num_sms(device.index or 0) if device.type == "cuda" else 132


def _split(programs: int, tiles: int, target: int) -> int:
    """K splits that bring a launch of `programs` to about `target` programs."""
    return 1 if programs >= target else max(1, min(tiles, triton.cdiv(target, programs)))


def gemv_config(n: int, k: int, bits: int, sms: int) -> GemvConfig:
    """Four rows a program (each thread's inputs of x serve all four; eight take twice the
    registers and a quarter of the occupancy),
    tiles of 128 chunks (4 warps) where K is a multiple of them, narrower tiles where it is
    not or where the layer is too narrow to fill the GPU (then K is split too)."""
    chunks = k // (128 // bits)
    # Never fewer chunks than a warp's threads (woq_gemv refuses such tiles): a short layer
    # takes one masked tile of 32 chunks.
    block_c = max(MIN_CHUNKS_A_WARP, min(128, triton.next_power_of_2(chunks)))
    while block_c > MIN_CHUNKS_A_WARP and chunks % block_c:
        block_c //= 2
    block_n = 4
    programs = triton.cdiv(n, block_n)
    target = GEMV_PROGRAMS_PER_SM * sms
    while block_c > MIN_CHUNKS_A_WARP and programs * triton.cdiv(chunks, block_c) < target:
        block_c //= 2
    split = _split(programs, triton.cdiv(chunks, block_c), target)
    return GemvConfig(block_n, block_c, max(1, min(4, block_c // 32)), split)


def gemm_config(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """Tiles of 64 rows of x (wgmma's least) by 128 weight rows, 8 warps: compiled, this
    tile takes fewer instructions a weight than 64 weight rows on 4 warps, at the same
    occupancy (the dequantization, not the MMA, is the work)."""
    block_m, block_n, num_warps = 64, 128, 8
    block_k = 128  # a multiple of every group size
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = _split(programs, triton.cdiv(k, block_k), GEMM_PROGRAMS_PER_SM * sms)
    return GemmConfig(block_m, block_n, block_k, num_warps, 3, split)


def _words(qweight: torch.Tensor) -> torch.Tensor:
    """The uint8 rows read as int32 words (little-endian: field i of word w holds code
    (32 // bits) * w + i)."""
    if not qweight.is_contiguous() or qweight.data_ptr() % 16:
        raise ValueError("qweight must be contiguous and 16-byte aligned")
    return qweight.view(torch.int32)


def _contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _partials(splits: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.empty((splits, m, n), dtype=torch.float32, device=device)


def woq_gemv(x, qweight, scales, mins, bits, group_size, bias=None, config=None):
    """x [1, K] -> [1, N], K a multiple of 128 // bits; config: GemvConfig (default
    gemv_config's). The weights are not rounded to x's dtype here: the result differs from
    woq_linear_ref's by that rounding at most."""
    n, k = scales.shape[0], x.shape[1]
    cfg = config or gemv_config(n, k, bits, num_sms(x.device))
    if cfg.block_c < MIN_CHUNKS_A_WARP * cfg.num_warps:
        raise ValueError(
            f"block_c {cfg.block_c} gives fewer chunks than the {cfg.num_warps} warps' threads"
        )
    if cfg.block_c * (128 // bits) % group_size:
        raise ValueError(f"a GEMV tile of {cfg.block_c} chunks holds no whole groups")
    tiles = triton.cdiv(k // (128 // bits), cfg.block_c)
    tiles_per_split = triton.cdiv(tiles, cfg.split)
    splits = triton.cdiv(tiles, tiles_per_split)
    row_blocks = triton.cdiv(n, cfg.block_n)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    part = _partials(splits, 1, n, x.device) if splits > 1 else y
    counters = split_counters(x.device, row_blocks if splits > 1 else 0)
    woq_gemv_kernel[(row_blocks, splits)](
        x, _words(qweight), scales, mins, bias if bias is not None else y, y, part, counters,
        n, k, k * bits // 32, scales.stride(0), tiles_per_split, MAGIC_LO, MAGIC_HI,
        BITS=bits, GROUP=group_size, BLOCK_N=cfg.block_n, BLOCK_C=cfg.block_c,
        BLOCK_S=triton.next_power_of_2(splits), HAS_BIAS=bias is not None, SPLIT=splits > 1,
        EVEN=k % (cfg.block_c * 128 // bits) == 0 and n % cfg.block_n == 0,
        **pdl_launch(x), num_warps=cfg.num_warps,
    )  # fmt: skip
    return y


def woq_gemm(x, qweight, scales, mins, bits, group_size, bias=None, config=None):
    """x [M, K] -> [M, N] on tensor cores; config: GemmConfig (default gemm_config's)."""
    (m, k), n = x.shape, scales.shape[0]
    cfg = config or gemm_config(m, n, k, num_sms(x.device))
    if cfg.block_k % group_size:
        raise ValueError(f"block_k {cfg.block_k} holds no whole groups of {group_size}")
    tiles = triton.cdiv(k, cfg.block_k)
    tiles_per_split = triton.cdiv(tiles, cfg.split)
    splits = triton.cdiv(tiles, tiles_per_split)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = _partials(splits, m, n, x.device) if splits > 1 else y
    counters = split_counters(x.device, grid[0] * grid[1] if splits > 1 else 0)
    woq_gemm_kernel[grid](
        x, _words(qweight), scales, mins, bias if bias is not None else y, y, part, counters,
        m, n, k, x.stride(0), k * bits // 32, scales.stride(0), y.stride(0), tiles_per_split,
        MAGIC_LO, MAGIC_HI,
        BITS=bits, GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None, SPLIT=splits > 1,
        EVEN=k % cfg.block_k == 0 and n % cfg.block_n == 0,
        **pdl_launch(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


def woq_dequantize_triton(qweight, scales, mins, bits, group_size, dtype):
    """The weight [N, K] in `dtype` (float16 or bfloat16), as kernels.woq_ref defines it."""
    n, k = check_woq(qweight, scales, mins, bits, group_size)
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n, block_k = DEQUANT_TILE
    woq_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        _words(qweight), scales, mins, out, n, k, k * bits // 32, scales.stride(0), out.stride(0),
        MAGIC_LO, MAGIC_HI, BITS=bits, GROUP=group_size, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=k % block_k == 0 and n % block_n == 0, **pdl_launch(qweight), num_warps=4,
    )  # fmt: skip
    return out


def woq_linear(x, qweight, scales, mins, bits, group_size, bias=None):
    """F.linear(x, W, bias) for the WOQ weight W of kernels/woq_ref.py: x [..., K] float16
    or bfloat16 -> [..., N] in x's dtype. One row takes W in float32 (woq_gemv), more rows
    W rounded to x's dtype, as woq_linear_ref does."""
    n, k = check_woq(qweight, scales, mins, bits, group_size)
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float16 or bfloat16, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the layer takes {k}")
    if scales.stride(1) != 1 or mins.stride(1) != 1 or mins.stride(0) != scales.stride(0):
        raise ValueError("scales and mins must be contiguous")
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 0:
        y = x.new_empty((0, n))
    elif m == 1 and k % (128 // bits) == 0:
        y = woq_gemv(_contiguous_rows(rows), qweight, scales, mins, bits, group_size, bias)
    elif m < DEQUANT_MIN_M:
        y = woq_gemm(_contiguous_rows(rows), qweight, scales, mins, bits, group_size, bias)
    else:
        w = woq_dequantize_triton(qweight, scales, mins, bits, group_size, x.dtype)
        y = F.linear(rows, w, bias)
    return y.reshape(*x.shape[:-1], n)


__all__ = [
    "DEQUANT_MIN_M",
    "GemmConfig",
    "GemvConfig",
    "gemm_config",
    "gemv_config",
    "woq_dequantize_triton",
    "woq_gemm",
    "woq_gemv",
    "woq_linear",
]
