"""Triton rotary embedding (rotate-half / NeoX layout); drop-in for rotary_ref.

Works in place on query and key, which may be strided views of one fused qkv tensor:
only the head_dim axis has to be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(
    ptr,
    token,
    stride_t,
    stride_h,
    num_heads,
    cos,
    sin,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (j[None, :] < HALF)
    lo = ptr + token * stride_t + h[:, None] * stride_h + j[None, :]
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    out_ty = ptr.dtype.element_ty
    tl.store(lo, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(lo + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cache
    cos = tl.load(row + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate(q_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, BLOCK_HQ, HALF, BLOCK_HALF)
    _rotate(k_ptr, token, stride_kt, stride_kh, num_kv_heads, cos, sin, BLOCK_HKV, HALF, BLOCK_HALF)


def apply_rotary_triton(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] in place at positions [T].

    cos_sin_cache [max_position, D]: cos in the first D/2 columns, sin in the last D/2.
    """
    assert query.dim() == 3 and key.dim() == 3, "query/key must be [T, H, D]"
    num_tokens, num_q_heads, head_dim = query.shape
    assert key.shape[0] == num_tokens and key.shape[2] == head_dim, "key must be [T, Hkv, D]"
    assert positions.shape == (num_tokens,), "positions must be [T]"
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim, "cache [P, D]"
    assert query.stride(2) == 1 and key.stride(2) == 1, "query/key head_dim must be contiguous"
    assert cos_sin_cache.stride(1) == 1, "cos_sin_cache rows must be contiguous"
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        num_q_heads,
        key.shape[1],
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(key.shape[1]),
    )
