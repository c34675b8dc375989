"""Triton flash-decoding over the paged cache: one launch per decode step.

Each program owns one (request, kv head, context partition) and attends with the query
rows of every head of that kv head's group at once, so each KV block is read once per
group. Partitions of one (request, kv head) write float32 partials and their log-sum-exp;
the last to finish (a counter per pair) merges them. A context that fits one partition
writes its output directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, wait_for_previous_kernel
from kernels.triton_attention import tuning
from kernels.triton_attention.common import KernelArgs, attend_tile

MIN_PARTITION = tl.constexpr(tuning.DECODE_MIN_PARTITION)


@triton.jit
def _seq_partition(seq_len, num_splits, max_partition, BLOCK_N: tl.constexpr):
    """Keys per split for this request: its own context spread over all the splits, in whole
    tiles and at least DECODE_MIN_PARTITION keys. The grid is sized for the longest context
    (a CUDA graph's for max_model_len), and a shorter one would otherwise leave all but its
    first split idle."""
    part = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.minimum(tl.maximum(part, MIN_PARTITION), max_partition)


@triton.jit
def _merge_partitions(
    out_ptr, part_out_ptr, part_lse_ptr, req, kv_head, q_start, num_valid,
    stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The output rows of the kv head's group: for each head, its num_valid partials
    weighted by their log-sum-exp."""
    d = tl.arange(0, BLOCK_D)
    # Each head's partitions in one load: a loop over partitions would wait on L2 per trip.
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_valid
    for g in tl.static_range(GROUP):
        head = kv_head * GROUP + g
        lse_row = part_lse_ptr + req * stride_lb + head * stride_lh
        # .cg: the other SMs' partials come from L2, never from a stale L1 line.
        lse_s = tl.load(lse_row + s, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
        m = tl.max(lse_s, 0)
        w = tl.exp2(lse_s - tl.where(m == float("-inf"), 0.0, m))
        part_s = tl.load(
            part_out_ptr + req * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
            mask=s_ok[:, None] & (d[None, :] < HEAD_DIM),
            other=0.0,
            cache_modifier=".cg",
        )
        total = tl.sum(w, 0)
        merged = tl.sum(part_s * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        tl.store(
            out_ptr + q_start * stride_ot + head * stride_oh + d,
            merged.to(out_ptr.dtype.element_ty),
            mask=d < HEAD_DIM,
        )


# Triton compiles a variant for each divisibility of an integer argument by 16; the split
# count's strides (stride_lb, stride_lh) would make splits of 9 and of 16 two compiles.
@triton.jit(do_not_specialize=["partition_size", "stride_bt", "stride_lb", "stride_lh"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_out_ptr, part_lse_ptr, counter_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, partition_size,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_S: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    part = _seq_partition(seq_len, tl.num_programs(2), partition_size, BLOCK_N)
    start = split * part
    # Split 0 always runs so that even an empty context writes its (zero) result.
    if q_len == 0 or (split > 0 and start >= seq_len):
        return
    end = tl.minimum(start + part, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    row_mask = g < GROUP
    q_mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_start * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + req * stride_bt
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, n0, end, m_i, k_cache_ptr, v_cache_ptr, table, kv_head, qk_scale,
            stride_cb, stride_cs, stride_ch,
            HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, MASKED=True, CAUSAL=False,
            KV_FP8=KV_FP8,
        )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)  # partials too: the merge is linear in them
    out = out_ptr + q_start * stride_ot + heads[:, None] * stride_oh + d[None, :]
    num_valid = 1
    if not SINGLE_SPLIT:
        num_valid = tl.minimum(tl.maximum(tl.cdiv(seq_len, part), 1), tl.num_programs(2))
    if num_valid == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=q_mask)
        return

    parts = part_out_ptr + req * stride_pb + heads[:, None] * stride_ph + d[None, :]
    tl.store(parts + split * stride_ps, acc, mask=q_mask)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    tl.store(part_lse_ptr + req * stride_lb + heads * stride_lh + split, lse, mask=row_mask)
    # Every thread's partial stores come before the counter's release; the program that
    # takes the count to num_valid sees all partitions' stores (acquire) and merges.
    tl.debug_barrier()
    counter = counter_ptr + req * tl.num_programs(1) + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") != num_valid - 1:
        return
    tl.store(counter, 0)  # ready for the next launch (graph replays reuse the counters)
    _merge_partitions(
        out_ptr, part_out_ptr, part_lse_ptr, req, kv_head, q_start, num_valid,
        stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
        GROUP, HEAD_DIM, BLOCK_D, BLOCK_S,
    )  # fmt: skip


_counters: dict[torch.device, torch.Tensor] = {}


def _merge_counters(device: torch.device, needed: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (request, kv head), kept per device: every decode
    kernel leaves them zero again. Grown only outside a CUDA-graph capture (the model
    runner's warm-up forward before each capture reaches the same size first)."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode merge counters must be sized before a graph capture")
        counters = torch.zeros(max(needed, 1 << 14), dtype=torch.int32, device=device)
        _counters[device] = counters
    return counters


def launch_decode(
    a: KernelArgs,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    num_splits: int | None,
) -> None:
    """The decode kernel over every request of these tensors (one query token each).
    num_splits None: tuning.decode_num_splits's choice."""
    query, out = a.query, a.out
    num_seqs = seq_lens.shape[0]
    if num_splits is None:
        num_sms = tuning.num_sms(query.device.index or 0) if query.is_cuda else 132
        num_splits = tuning.decode_num_splits(num_seqs, a.num_kv_heads, max_seq_len, num_sms)
    tile = tuning.decode_tile(a.group, num_splits, a.float32)
    block_n = tile.block_n
    partition = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    single = num_splits == 1
    if single:
        # The kernel writes the final output directly; the partial buffers go unused.
        part_out, part_lse, counters = out, out, out
        part_strides = (0, 0, 0, 0, 0)
    else:
        part_out = torch.empty(
            (num_seqs, a.num_heads, num_splits, a.block_d), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_seqs, a.num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        part_strides = (*part_out.stride()[:3], *part_lse.stride()[:2])
        counters = _merge_counters(query.device, num_seqs * a.num_kv_heads)
    _decode_kernel[(num_seqs, a.num_kv_heads, num_splits)](
        query,
        a.k_cache,
        a.v_cache,
        out,
        part_out,
        part_lse,
        counters,
        query_start_loc,
        seq_lens,
        block_tables,
        a.k_scale,
        a.v_scale,
        a.qk_scale,
        partition,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *a.cache_strides,
        block_tables.stride(0),
        *part_strides,
        GROUP=a.group,
        HEAD_DIM=a.head_dim,
        BLOCK_G=tile.block_g,
        BLOCK_D=a.block_d,
        BLOCK_N=block_n,
        BLOCK_SIZE=a.block_size,
        BLOCK_S=triton.next_power_of_2(num_splits),
        SINGLE_SPLIT=single,
        DOT_PRECISION=a.precision,
        KV_FP8=a.kv_fp8,
        **pdl_launch(query),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
