"""Torch references for the paged KV store and paged attention (CPU path and test oracle).

Cache layout per layer: kv_cache[0] holds keys, kv_cache[1] values, each
[num_blocks, block_size, num_kv_heads, head_dim]. A token's slot is
block_id * block_size + offset_in_block.

A batch is ragged: request i owns query rows query_start_loc[i]:query_start_loc[i+1]
(a prefill chunk or a single decode token) and has seq_lens[i] tokens of context in
total, the new ones included, already stored in the cache. Its query row j sits at
position seq_lens[i] - q_len + j and attends to positions 0..that position.
"""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [T, Hkv, D] into kv_cache at slot_mapping [T] (negative slots skipped)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    flat[0, slots] = key[valid].to(kv_cache.dtype)
    flat[1, slots] = value[valid].to(kv_cache.dtype)


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
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over paged context; returns [T, Hq, D], in
    `out` when given (rows that no request owns are left as they are). num_decodes is the
    Triton kernel's hint (see kernels.paged_attention); the reference does not need it."""
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
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = k.repeat_interleave(group, dim=1).float()
        v = v.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
