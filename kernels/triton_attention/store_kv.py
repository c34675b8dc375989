"""Triton paged KV store: each token's key and value rows into its cache slot (an fp8
cache's divided by their scales, kv_fp8.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, wait_for_previous_kernel
from kernels.triton_attention.kv_fp8 import kv_scale_args, load_inverse_scale, to_cache


@triton.jit
def paged_slot_offsets(slot, h, d, stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr):
    """Offsets of heads `h` x dims `d` of cache slot `slot` (block slot // BLOCK_SIZE)."""
    return (
        (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_cs
        + h[:, None] * stride_ch
        + d[None, :]
    )


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    cache_off = paged_slot_offsets(slot, h, d, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    cache_ty = k_cache_ptr.dtype.element_ty
    k = to_cache(k, load_inverse_scale(k_scale_ptr, KV_FP8), cache_ty, KV_FP8)
    v = to_cache(v, load_inverse_scale(v_scale_ptr, KV_FP8), cache_ty, KV_FP8)
    tl.store(k_cache_ptr + cache_off, k, mask=mask)
    tl.store(v_cache_ptr + cache_off, v, mask=mask)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value [T, Hkv, D] into kv_cache at slot_mapping [T] (negative slots
    skipped); an fp8 cache gets key / k_scale and value / v_scale (None: 1.0)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, N, B, Hkv, D]"
    assert tuple(kv_cache.shape[3:]) == (num_kv_heads, head_dim), "kv_cache heads/dim mismatch"
    assert slot_mapping.shape == (num_tokens,), "slot_mapping must be [T]"
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value head_dim must be contiguous"
    assert kv_cache.stride(4) == 1, "kv_cache head_dim must be contiguous"
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_scale, v_scale, kv_fp8 = kv_scale_args(kv_cache, k_scale, v_scale)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        KV_FP8=kv_fp8,
        **pdl_launch(key),
    )
