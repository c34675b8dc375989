"""Triton attention for prefill chunks (possibly beside decodes) over the paged cache.

Each program owns a tile of query tokens x the group's heads of one request and kv head,
and walks the request's blocks up to the tile's last causal position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, wait_for_previous_kernel
from kernels.triton_attention import tuning
from kernels.triton_attention.common import KernelArgs, attend_tile


@triton.jit(do_not_specialize=["stride_bt", "first_req"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    first_req,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    # Row r of the tile is query token q_tile * BLOCK_Q + r // GROUP of head r % GROUP in
    # this kv head's group, so one K/V tile load serves every head of the group.
    req = first_req + tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    tok = q_tile * BLOCK_Q + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    row_mask = (r < BLOCK_Q * GROUP) & (tok < q_len)
    q_mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=q_mask)
    q_pos = context_len + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + req * stride_bt
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    # Keys up to the tile's first query position are visible to every row: those tiles
    # skip the causal mask. Keys past its last query position are masked for every row.
    # Key 0 is visible to every row, so m_i is finite after the first tile.
    unmasked_end = (context_len + q_tile * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    kv_end = context_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    for n0 in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, n0, kv_end, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head,
            qk_scale, stride_cb, stride_cs, stride_ch,
            HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, MASKED=False, CAUSAL=True,
            KV_FP8=KV_FP8,
        )  # fmt: skip
    for n0 in range(unmasked_end, kv_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, n0, kv_end, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head,
            qk_scale, stride_cb, stride_cs, stride_ch,
            HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, MASKED=True, CAUSAL=True,
            KV_FP8=KV_FP8,
        )  # fmt: skip

    acc = acc / l_i[:, None]
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def launch_prefill(
    a: KernelArgs,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    first_req: int,
) -> None:
    """Requests first_req.. of the batch. An index rather than sliced tensors: Triton
    specializes a kernel on each pointer's 16-byte alignment, and slices at every decode
    count would compile it again and again during serving."""
    query, out = a.query, a.out
    _, block_n, num_warps, num_stages = tuning.prefill_config(a.float32)
    block_m = tuning.prefill_block_m(max_query_len, a.group, a.float32)
    block_q = block_m // a.group
    grid = (seq_lens.shape[0] - first_req, triton.cdiv(max_query_len, block_q), a.num_kv_heads)
    _prefill_kernel[grid](
        query,
        a.k_cache,
        a.v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        a.k_scale,
        a.v_scale,
        a.qk_scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *a.cache_strides,
        block_tables.stride(0),
        first_req,
        GROUP=a.group,
        HEAD_DIM=a.head_dim,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_D=a.block_d,
        BLOCK_N=block_n,
        BLOCK_SIZE=a.block_size,
        DOT_PRECISION=a.precision,
        KV_FP8=a.kv_fp8,
        **pdl_launch(query),
        num_warps=num_warps,
        num_stages=num_stages,
    )
