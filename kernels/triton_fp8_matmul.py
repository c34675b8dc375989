"""Triton matrix products with an fp8 (e4m3) weight W [N, K] and float32 weight scales.

Two kernels:
- `fp8_gemv`: one token (x [1, K], 16-bit). The house GEMV (kernels/triton_gemv.py) with the
  weight read as fp8 and widened in registers: each program streams BLOCK_N rows in
  BLOCK_K-wide tiles and reduces once at the end. An fp8 row is half the bytes of a 16-bit
  one, so BLOCK_N is 4 rather than 2: the same bytes of weight per tile, and the x vector
  every program reads from L2 stays half its weight bytes.
- `fp8_gemm`: a tiled tensor-core GEMM for every other batch. A is either 16-bit (the weight
  tile is widened to A's dtype in registers: W8A16) or fp8 with one scale per row and
  group of the block's columns (W8A8, for block-scaled weights).

Weight scales are per output channel (a vector of N, or one value read with stride 0) or
per block (scale_inv [ceil(N/bn), ceil(K/bk)]). Block scales apply per K step: the GEMM's
BLOCK_K divides the block's column count, so each K tile lies in one block column; the
GEMV scales x by the block's scale as it streams (a program's rows lie in one block row).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.fp8_ref import FP8_DOT_MIN_K, block_k_step, cdiv
from kernels.pdl import pdl_launch, wait_for_previous_kernel

GEMV_BLOCK_N = 4
GEMV_BLOCK_K = 1024
GEMV_NUM_WARPS = 4
# At most 16 tokens the GEMM streams the weight once with one 16-row tile of tokens; wider
# weight tiles when there are enough of them to fill the GPU.
SMALL_M = 16
GEMM_BLOCK_K = 128


@triton.jit
def _gemv_x_tile(
    x_ptr, s_row, k, cols, groups, K, stride_sk, GROUP_K: tl.constexpr, BLOCK_SCALES: tl.constexpr
):
    """x[k:k+BLOCK_K] in float32 as a tile of the weight tile's shape (every row the same),
    times the block scales of its column groups where the weight has them."""
    x = tl.load(x_ptr + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
    if BLOCK_SCALES:
        scales = tl.load(s_row + (k // GROUP_K + groups) * stride_sk, mask=k + groups * GROUP_K < K)
        x *= scales[None, :, None]
    return x


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_w,
    stride_sn,
    stride_sk,
    SCALE_BLOCK_N: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Tiles are [BLOCK_N, BLOCK_K // GROUP_K, GROUP_K]: a group of GROUP_K columns (the
    # block's width with block scales, else all BLOCK_K) on the last axis. x is read as a
    # whole tile, not a [BLOCK_K] vector, so that it takes the weight's register layout
    # (16 elements a thread, as 16 fp8 bytes make one vector load); a vector gets 8 (16
    # bytes of bf16) and is re-laid through shared memory, with barriers, every step. Its
    # repeated rows are L1 hits.
    first_row = tl.program_id(0) * BLOCK_N
    rows = first_row + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    groups = tl.arange(0, BLOCK_K // GROUP_K)
    cols = groups[None, :, None] * GROUP_K + tl.arange(0, GROUP_K)[None, None, :]
    cols = cols + 0 * rows[:, None, None]
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None, None] * stride_w + cols
    # The first weight tile is read before the wait, as in kernels/triton_gemv.py.
    w = tl.load(
        w_ptrs, mask=row_ok[:, None, None] & (cols < K), other=0.0, eviction_policy="evict_first"
    )
    wait_for_previous_kernel(USE_PDL)
    s_row = s_ptr + (first_row // SCALE_BLOCK_N) * stride_sn
    x = _gemv_x_tile(x_ptr, s_row, 0, cols, groups, K, stride_sk, GROUP_K, BLOCK_SCALES)
    acc = w.to(tl.float32) * x
    for k in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(
            w_ptrs + k,
            mask=row_ok[:, None, None] & (k + cols < K),
            other=0.0,
            eviction_policy="evict_first",
        )
        x = _gemv_x_tile(x_ptr, s_row, k, cols, groups, K, stride_sk, GROUP_K, BLOCK_SCALES)
        acc += w.to(tl.float32) * x
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if not BLOCK_SCALES:
        y *= tl.load(s_ptr + rows * stride_sn, mask=row_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


# M and the activation scales' column stride (M) change with the batch: unspecialized, so
# that a batch size does not build its own variant.
@triton.jit(do_not_specialize=["M", "stride_asg"])
def _fp8_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_cm,
    stride_asm,
    stride_asg,
    stride_wsn,
    stride_wsk,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    A_FP8: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Programs walk GROUP_M tiles of rows per column of tiles, so neighbours share A and W
    # tiles in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    w_scale_ptrs = w_scale_ptr + (offs_n // SCALE_BLOCK_N) * stride_wsn
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm
    wait_for_previous_kernel(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = k + offs_k < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if A_FP8 or BLOCK_SCALES:
            # A K tile lies in one scale column: scale its partial product, then add.
            part = tl.dot(a, w) if A_FP8 else tl.dot(a, w.to(a.dtype))
            if BLOCK_SCALES:
                s_k = (k // SCALE_BLOCK_K) * stride_wsk
                part *= tl.load(w_scale_ptrs + s_k, mask=n_ok, other=0.0)[None, :]
            if A_FP8:
                a_s = (k // SCALE_BLOCK_K) * stride_asg
                part *= tl.load(a_scale_ptrs + a_s, mask=m_ok, other=0.0)[:, None]
            acc += part
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not BLOCK_SCALES:
        acc *= tl.load(w_scale_ptrs, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _scale_strides(scale: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int]:
    """(stride per scale row, stride per scale column) of the weight scales; a per-tensor
    scale is read with stride 0 by every channel."""
    if block is not None:
        return scale.stride(0), scale.stride(1)
    return (0 if scale.numel() == 1 else scale.stride(0)), 0


def gemv_fits(block: tuple[int, int] | None) -> bool:
    """Whether fp8_gemv takes this weight's scales: a program's rows lie in one block row,
    and a power-of-two block width divides its K step."""
    if block is None:
        return True
    bn, bk = block
    return bn % GEMV_BLOCK_N == 0 and bk & (bk - 1) == 0 and GEMV_BLOCK_K % bk == 0


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x [1, K] 16-bit, contiguous -> [1, N] in x's dtype; block None: per-channel scale."""
    n, k = weight.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    stride_sn, stride_sk = _scale_strides(scale, block)
    _fp8_gemv_kernel[(cdiv(n, GEMV_BLOCK_N),)](
        x,
        weight,
        scale,
        bias if bias is not None else scale,
        y,
        n,
        k,
        weight.stride(0),
        stride_sn,
        stride_sk,
        SCALE_BLOCK_N=block[0] if block else 1,
        BLOCK_SCALES=block is not None,
        HAS_BIAS=bias is not None,
        BLOCK_N=GEMV_BLOCK_N,
        BLOCK_K=GEMV_BLOCK_K,
        GROUP_K=block[1] if block else GEMV_BLOCK_K,
        **pdl_launch(x),
        num_warps=GEMV_NUM_WARPS,
    )
    return y


def gemm_block_k(block: tuple[int, int] | None, fp8_operands: bool = False) -> int | None:
    """The GEMM's BLOCK_K for these scales: the largest power of two up to GEMM_BLOCK_K that
    divides the block's columns; None where that is under a tensor-core dot's least K step
    (16, or 32 for two fp8 operands)."""
    if block is None:
        return GEMM_BLOCK_K
    return block_k_step(block[1], FP8_DOT_MIN_K if fp8_operands else 16)


def _gemm_tiles(m: int, n: int, device: torch.device) -> dict[str, int]:
    if m <= SMALL_M:
        sms = _num_sms(device.index or 0) if device.type == "cuda" else 132
        block_n = next((b for b in (64, 32) if cdiv(n, b) >= sms), 16)
        return dict(BLOCK_M=16, BLOCK_N=block_n, GROUP_M=1, num_warps=4, num_stages=4)
    block_m = 64 if m <= 64 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """a [M, K] (unit column stride) @ dequantized weight.T -> [M, N] of out_dtype.

    a 16-bit: a_scale None. a fp8: a_scale [M, ceil(K / block[1])] float32 per row and
    group (block scales only). block None: per-channel scale; else gemm_block_k(block)
    must not be None."""
    m, k = a.shape
    n = weight.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    tiles = _gemm_tiles(m, n, a.device)
    grid = (cdiv(m, tiles["BLOCK_M"]) * cdiv(n, tiles["BLOCK_N"]),)
    stride_wsn, stride_wsk = _scale_strides(scale, block)
    _fp8_gemm_kernel[grid](
        a,
        a_scale if a_scale is not None else scale,
        weight,
        scale,
        bias if bias is not None else scale,
        c,
        m,
        n,
        k,
        a.stride(0),
        weight.stride(0),
        c.stride(0),
        a_scale.stride(0) if a_scale is not None else 0,
        a_scale.stride(1) if a_scale is not None else 0,
        stride_wsn,
        stride_wsk,
        SCALE_BLOCK_N=block[0] if block else 1,
        SCALE_BLOCK_K=block[1] if block else 1,
        A_FP8=a_scale is not None,
        BLOCK_SCALES=block is not None,
        HAS_BIAS=bias is not None,
        BLOCK_K=gemm_block_k(block, fp8_operands=a_scale is not None),
        **tiles,
        **pdl_launch(a),
    )
    return c
