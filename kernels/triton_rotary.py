"""Triton rotary embedding (rotate-half / NeoX layout); drop-in for rotary_ref.

Works in place on query and key, which may be strided views of one fused qkv tensor:
only the head_dim axis has to be contiguous. `rotary_store_kv_triton` also writes the
rotated key and the value into the paged KV cache in the same pass (one kernel per layer
instead of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, wait_for_previous_kernel
from kernels.triton_attention.kv_fp8 import kv_scale_args, load_inverse_scale, to_cache
from kernels.triton_attention.store_kv import paged_slot_offsets


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
    """Rotate one token's heads in place; returns the two rotated halves as stored."""
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (j[None, :] < HALF)
    lo = ptr + token * stride_t + h[:, None] * stride_h + j[None, :]
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    out_ty = ptr.dtype.element_ty
    r1 = (x1 * cos - x2 * sin).to(out_ty)
    r2 = (x2 * cos + x1 * sin).to(out_ty)
    tl.store(lo, r1, mask=mask)
    tl.store(lo + HALF, r2, mask=mask)
    return r1, r2


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache,
    stride_cb,
    stride_cs,
    stride_ch,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    STORE_KV: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cache
    cos = tl.load(row + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate(q_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, BLOCK_HQ, HALF, BLOCK_HALF)
    k1, k2 = _rotate(
        k_ptr, token, stride_kt, stride_kh, num_kv_heads, cos, sin, BLOCK_HKV, HALF, BLOCK_HALF
    )
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        h = tl.arange(0, BLOCK_HKV)
        mask = (h[:, None] < num_kv_heads) & (j[None, :] < HALF)
        cache_lo = paged_slot_offsets(slot, h, j, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        # The key as rotated in place (rounded to its dtype), as a separate store would copy it.
        cache_ty = k_cache_ptr.dtype.element_ty
        k_inv = load_inverse_scale(k_scale_ptr, KV_FP8)
        tl.store(k_cache_ptr + cache_lo, to_cache(k1, k_inv, cache_ty, KV_FP8), mask=mask)
        tl.store(k_cache_ptr + cache_lo + HALF, to_cache(k2, k_inv, cache_ty, KV_FP8), mask=mask)
        v_lo = v_ptr + token * stride_vt + h[:, None] * stride_vh + j[None, :]
        v1 = tl.load(v_lo, mask=mask, other=0.0)
        v2 = tl.load(v_lo + HALF, mask=mask, other=0.0)
        v_inv = load_inverse_scale(v_scale_ptr, KV_FP8)
        tl.store(v_cache_ptr + cache_lo, to_cache(v1, v_inv, cache_ty, KV_FP8), mask=mask)
        tl.store(v_cache_ptr + cache_lo + HALF, to_cache(v2, v_inv, cache_ty, KV_FP8), mask=mask)


def apply_rotary_triton(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] in place at positions [T].

    cos_sin_cache [max_position, D]: cos in the first D/2 columns, sin in the last D/2.
    """
    _launch(positions, query, key, cos_sin_cache)


def rotary_store_kv_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """apply_rotary_triton, then key and value [T, Hkv, D] into kv_cache [2, N, B, Hkv, D]
    at slot_mapping [T] (negative slots skipped): one kernel. An fp8 cache gets key /
    k_scale and value / v_scale (None: 1.0)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert slot_mapping.shape == (num_tokens,), "slot_mapping must be [T]"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, N, B, Hkv, D]"
    assert tuple(kv_cache.shape[3:]) == (num_kv_heads, head_dim), "kv_cache heads/dim mismatch"
    assert value.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must be contiguous"
    scales = kv_scale_args(kv_cache, k_scale, v_scale)
    _launch(positions, query, key, cos_sin_cache, (value, kv_cache, slot_mapping, *scales))


def _launch(positions, query, key, cos_sin_cache, store_kv=None) -> None:
    assert query.dim() == 3 and key.dim() == 3, "query/key must be [T, H, D]"
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert key.shape[0] == num_tokens and key.shape[2] == head_dim, "key must be [T, Hkv, D]"
    assert positions.shape == (num_tokens,), "positions must be [T]"
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim, "cache [P, D]"
    assert query.stride(2) == 1 and key.stride(2) == 1, "query/key head_dim must be contiguous"
    assert cos_sin_cache.stride(1) == 1, "cos_sin_cache rows must be contiguous"
    if num_tokens == 0:
        return
    if store_kv is None:
        # Unused pointers and strides when STORE_KV is off.
        value, k_cache, v_cache, slot_mapping, block_size = key, key, key, positions, 1
        k_scale, v_scale, kv_fp8 = key, key, False
        cache_strides = (0, 0, 0)
    else:
        value, kv_cache, slot_mapping, k_scale, v_scale, kv_fp8 = store_kv
        k_cache, v_cache, block_size = kv_cache[0], kv_cache[1], kv_cache.shape[2]
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        value,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos_sin_cache.stride(0),
        *cache_strides,
        num_q_heads,
        num_kv_heads,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=block_size,
        STORE_KV=store_kv is not None,
        KV_FP8=kv_fp8,
        **pdl_launch(query),
    )
