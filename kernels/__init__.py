"""Kernels behind one signature each: Triton on CUDA tensors, torch references elsewhere.

Set KVRAY_TORCH_KERNELS=1 to force the references on a GPU too (the oracle path).
The Triton modules are imported on first use, so CPU-only installs never load triton.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels.activation_ref import silu_and_mul_ref
from kernels.attention_ref import paged_attention_ref, store_kv_ref
from kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary_ref import apply_rotary_ref


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and os.environ.get("KVRAY_TORCH_KERNELS", "0") != "1"


def store_kv(key, value, kv_cache, slot_mapping) -> None:
    if use_triton(key):
        from kernels.triton_attention import store_kv_triton

        return store_kv_triton(key, value, kv_cache, slot_mapping)
    return store_kv_ref(key, value, kv_cache, slot_mapping)


def paged_attention(
    query,
    kv_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    max_query_len,
    max_seq_len,
    num_decodes=0,
    out=None,
):
    """num_decodes: how many leading requests have one query token (a GPU batch splits them
    off to the decode kernel); the reference does not need it. out: write the result there
    (a contiguous tensor like query) rather than in a new tensor."""
    args = (
        query,
        kv_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        max_query_len,
        max_seq_len,
    )
    if use_triton(query):
        from kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(*args, num_decodes=num_decodes, out=out)
    return paged_attention_ref(*args, out=out)


def rms_norm(x, weight, eps):
    if use_triton(x):
        from kernels.triton_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    if use_triton(x):
        from kernels.triton_norm import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def apply_rotary(positions, query, key, cos_sin_cache) -> None:
    if use_triton(query):
        from kernels.triton_rotary import apply_rotary_triton

        return apply_rotary_triton(positions, query, key, cos_sin_cache)
    return apply_rotary_ref(positions, query, key, cos_sin_cache)


def rotary_store_kv(positions, query, key, value, cos_sin_cache, kv_cache, slot_mapping) -> None:
    """apply_rotary on query and key, then store_kv of the rotated key and value."""
    if use_triton(query):
        from kernels.triton_rotary import rotary_store_kv_triton

        return rotary_store_kv_triton(
            positions, query, key, value, cos_sin_cache, kv_cache, slot_mapping
        )
    apply_rotary_ref(positions, query, key, cos_sin_cache)
    store_kv_ref(key, value, kv_cache, slot_mapping)


def _gemv_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and use_triton(x)
    )


def linear(x, weight, bias=None):
    """F.linear; a one-row 16-bit input on a GPU takes the Triton GEMV."""
    if _gemv_eligible(x, weight):
        from kernels.triton_gemv import gemv_triton

        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_and_mul(x):
    if use_triton(x):
        from kernels.triton_activation import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


__all__ = [
    "apply_rotary",
    "fused_add_rms_norm",
    "linear",
    "paged_attention",
    "rms_norm",
    "rotary_store_kv",
    "silu_and_mul",
    "store_kv",
    "use_triton",
]
