"""What the decode and prefill kernels share: the online-softmax step over one tile of
keys, and the launch arguments both take from an attention call.

With an fp8 cache (KV_FP8) the tiles are widened to the query's dtype for the dots; the
kernels fold k_scale into the softmax scale and v_scale into the output (both exact:
every score is linear in its key, every output row in the values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_attention.kv_fp8 import kv_scale_args

LOG2E = 1.4426950408889634


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    n0,
    end,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    table,
    kv_head,
    qk_scale,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online-softmax update of (m_i, l_i, acc) with keys n0 .. n0 + BLOCK_N - 1.

    Keys at or past `end` are skipped, and with CAUSAL those past each row's q_pos too.
    Unmasked tiles (MASKED=False) must lie wholly inside both limits.
    """
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    # Loads stay masked either way: their predicate is per key row, so it costs nothing
    # next to the K/V bytes, and stale slots past `end` may hold anything (NaN included).
    n_mask = n < end
    block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    kv_ptrs = (block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch)[:, None]
    kv_ptrs += d[None, :]
    kv_mask = n_mask[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    if KV_FP8:
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        if CAUSAL:
            s = tl.where(n_mask[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        else:
            s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


class KernelArgs:
    """What the decode and prefill launches of one attention call share."""

    def __init__(self, query, kv_cache, out, scale, k_scale=None, v_scale=None):
        self.query, self.out = query, out
        num_heads, head_dim = query.shape[1], query.shape[2]
        self.block_size, self.num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        self.group = num_heads // self.num_kv_heads
        self.num_heads, self.head_dim = num_heads, head_dim
        self.k_cache, self.v_cache = kv_cache[0], kv_cache[1]
        self.block_d = max(16, triton.next_power_of_2(head_dim))
        self.float32 = query.dtype == torch.float32
        self.precision = "ieee" if self.float32 else "tf32"
        self.qk_scale = scale * LOG2E
        k = self.k_cache
        self.cache_strides = (k.stride(0), k.stride(1), k.stride(2))
        self.k_scale, self.v_scale, self.kv_fp8 = kv_scale_args(kv_cache, k_scale, v_scale)
