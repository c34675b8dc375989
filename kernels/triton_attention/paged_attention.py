"""paged_attention_triton: checks an attention call and launches the decode kernel, the
prefill kernel or both; and the warm-up that compiles the decode kernel's variants."""

from __future__ import annotations

import torch

from kernels.triton_attention.common import KernelArgs
from kernels.triton_attention.decode import launch_decode
from kernels.triton_attention.kv_fp8 import FP8_KV_DTYPE
from kernels.triton_attention.prefill import launch_prefill
from kernels.triton_attention.tuning import decode_split_variants


def _check_attention_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    assert query.dim() == 3, "query must be [T, Hq, D]"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, N, B, Hkv, D]"
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    assert kv_cache.shape[4] == head_dim, f"kv_cache head_dim {kv_cache.shape[4]} != {head_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} q heads not a multiple of {num_kv_heads}"
    assert kv_cache.dtype in (query.dtype, FP8_KV_DTYPE), (
        f"kv_cache {kv_cache.dtype} is neither the query's {query.dtype} nor fp8"
    )
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must be contiguous"
    block_size = kv_cache.shape[2]
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} must be a power of two"
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_seqs + 1,), "query_start_loc must be [B + 1]"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, "block_tables [B, M]"
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"


def _output(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(query)
    assert out.shape == query.shape and out.dtype == query.dtype, "out must be like query"
    assert out.is_contiguous(), "out must be contiguous"
    return out


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    num_decodes: int = 0,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over paged context; returns [T, Hq, D].

    max_query_len / max_seq_len may be upper bounds (CUDA graphs capture with the
    largest). The first `num_decodes` requests have one query token each: in a batch that
    also holds longer queries they take the decode kernel, and the prefill kernel's grid
    covers only the rest (its programs for query tiles past a request's length would
    otherwise be launched for every decode, and its query tiles are mostly empty rows
    for them). num_splits overrides the decode partition count (benchmarks). `out`: a
    contiguous [T, Hq, D] tensor to write into instead of a new one; rows that no request
    owns are left as they are. k_scale / v_scale: an fp8 cache's keys and values read as
    stored * scale (None: 1.0); a 16-bit cache ignores them.
    """
    _check_attention_args(query, kv_cache, query_start_loc, seq_lens, block_tables)
    num_tokens = query.shape[0]
    num_seqs = seq_lens.shape[0]
    out = _output(query, out)
    if num_tokens == 0 or num_seqs == 0:
        return out
    args = KernelArgs(query, kv_cache, out, scale, k_scale, v_scale)
    if max_query_len == 1:
        launch_decode(args, query_start_loc, seq_lens, block_tables, max_seq_len, num_splits)
        return out
    if 0 < num_decodes < num_seqs:
        # Unsplit: beside a prefill the GPU has work enough, and one kernel variant serves
        # every mixed batch (the engine's warm-up compiles it; a split count is a constexpr).
        launch_decode(
            args,
            query_start_loc[: num_decodes + 1],
            seq_lens[:num_decodes],
            block_tables[:num_decodes],
            max_seq_len,
            num_splits or 1,
        )
    else:
        num_decodes = 0
    launch_prefill(args, query_start_loc, seq_lens, block_tables, max_query_len, num_decodes)
    return out


def warm_up_decode(
    kv_cache: torch.Tensor, num_heads: int, scale: float, dtype: torch.dtype | None = None
) -> None:
    """Compile every decode kernel variant for this cache's shape now. Steps without CUDA
    graphs (enforce_eager, pipeline stages) pick the split count from the batch and its
    longest context, and would otherwise compile the variants one by one while serving.
    dtype: the queries' (None: the cache's; an fp8 cache needs it)."""
    device, head_dim = kv_cache.device, kv_cache.shape[4]
    if dtype is None:
        assert kv_cache.dtype != FP8_KV_DTYPE, "an fp8 cache's warm-up needs the query dtype"
        dtype = kv_cache.dtype
    query = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    block_tables = torch.zeros(1, 1, dtype=torch.int32, device=device)  # the null block
    for splits in decode_split_variants():
        paged_attention_triton(
            query, kv_cache, query_start_loc, seq_lens, block_tables, scale, 1, 1,
            num_splits=splits,
        )  # fmt: skip
