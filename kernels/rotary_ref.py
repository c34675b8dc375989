"""Torch reference for rotary position embedding (rotate-half / NeoX layout, as HF Llama)."""

from __future__ import annotations

import torch

from kernels.attention_ref import store_kv_ref


def apply_rotary_ref(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] in place.

    cos_sin_cache [max_position, D]: cos in the first D/2 columns, sin in the last D/2.
    Plain and llama3-scaled rope differ only in how the cache was built.
    """
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()].float()
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    for t in (query, key):
        x1 = t[..., :half].float()
        x2 = t[..., half:].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        t.copy_(rotated.to(t.dtype))


def rotary_store_kv_ref(
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
    """apply_rotary_ref on query and key, then store_kv_ref of the rotated key and value."""
    apply_rotary_ref(positions, query, key, cos_sin_cache)
    store_kv_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)
