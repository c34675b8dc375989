"""Torch references for the paged KV store and paged attention (CPU path and test oracle).

Cache layout per layer: kv_cache[0] holds keys, kv_cache[1] values, each
[num_blocks, block_size, num_kv_heads, head_dim]. A token's slot is
block_id * block_size + offset_in_block.

A batch is ragged: request i owns query rows query_start_loc[i]:query_start_loc[i+1]
(a prefill chunk or a single decode token) and has seq_lens[i] tokens of context in
total, the new ones included, already stored in the cache. Its query row j sits at
position seq_lens[i] - q_len + j and attends to positions 0..that position.

An fp8 cache (float8_e4m3fn) stores key / k_scale and value / v_scale, saturated to the
format's +-448, and reads back stored * scale; the scales are float32 one-element tensors
per layer (None: 1.0). A cache of any other dtype stores the values cast and ignores the
scales.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value: a cast of anything larger would give NaN."""


def quantize_kv_ref(
    x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """x as a cache of `cache_dtype` holds it. fp8: x times the reciprocal of `scale` (as
    the kernels compute x / scale), in float32, saturated to +-FP8_MAX, rounded to nearest."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    x = x.float()
    if scale is not None:
        x = x * (1.0 / scale.float().reshape(()))
    return x.clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv_ref(stored: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Cache entries as float32 values: an fp8 cache's times `scale`, others as they are."""
    values = stored.float()
    if stored.dtype == FP8_KV_DTYPE and scale is not None:
        values = values * scale.float().reshape(())
    return values


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value [T, Hkv, D] into kv_cache at slot_mapping [T] (negative slots
    skipped); an fp8 cache gets key / k_scale and value / v_scale."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    flat = _indexable(kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:]))
    flat[0, slots] = _indexable(quantize_kv_ref(key[valid], kv_cache.dtype, k_scale))
    flat[1, slots] = _indexable(quantize_kv_ref(value[valid], kv_cache.dtype, v_scale))


def _indexable(t: torch.Tensor) -> torch.Tensor:
    """t, or for float8 its bytes: not every torch build indexes float8 on every device."""
    return t.view(torch.uint8) if t.dtype == FP8_KV_DTYPE else t


def _gather(kv_cache: torch.Tensor, kv: int, blocks: torch.Tensor) -> torch.Tensor:
    """kv_cache[kv, blocks], in the cache's dtype."""
    return _indexable(kv_cache)[kv, blocks].view(kv_cache.dtype)


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_decodes: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over paged context; returns [T, Hq, D], in
    `out` when given (rows that no request owns are left as they are). num_decodes is the
    Triton kernel's hint (see kernels.paged_attention); the reference does not need it.
    An fp8 cache's keys and values read as stored * k_scale and stored * v_scale."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query) if out is None else out
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q = query[starts[i] : starts[i + 1]]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        k = _gather(kv_cache, 0, blocks).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = _gather(kv_cache, 1, blocks).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = dequantize_kv_ref(k, k_scale).repeat_interleave(group, dim=1)
        v = dequantize_kv_ref(v, v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
