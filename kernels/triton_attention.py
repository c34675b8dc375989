"""Triton paged KV store and paged attention; drop-ins for attention_ref.

Two attention kernels, picked on the host from max_query_len:

- decode (every request has one query token): flash-decoding. Each program owns one
  (request, kv head, context partition) and loads the query rows of all heads in that
  kv head's group together, so every KV block is read once per group. The last partition
  of a (request, kv head) to finish merges them all by their log-sum-exp (a counter per
  pair says which one is last), so a decode is one launch; a context that fits one
  partition writes its output directly.
- general (prefill chunks, possibly mixed with decodes): each program owns a tile of
  query tokens x group heads of one request and kv head, and walks the request's blocks
  up to the tile's last causal position.

Both are CUDA-graph capturable: grids and temporaries are sized from shapes and from
max_seq_len / max_query_len, which the caller passes as Python ints (upper bounds are
fine: programs past a request's real length return at once).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, wait_for_previous_kernel

LOG2E = 1.4426950408889634

# Integer arguments that change from step to step (block-table width, partition size) are
# left unspecialized: Triton would otherwise compile a variant per class of value (1, a
# multiple of 16, other) the first time each appears, in the middle of serving.

# Decode tuning, chosen from bench/kernels.py on an H200 (see bench/NOTES-kernels.md).
DECODE_BLOCK_N = 64
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
# Partitions shorter than this spend more on the merge than they win in parallelism. At
# batch 1 over 384 keys (llama3-8b, H200) neither split won: 9.4 us a layer as 6
# partitions of 64 merged by the last one, 9.8 us as one 384-key partition per kv head.
DECODE_MIN_PARTITION = 512
MIN_PARTITION = tl.constexpr(DECODE_MIN_PARTITION)
DECODE_MAX_SPLITS = 64
# Groups of <= 2 query heads per kv head (qwen3-0.6b's 16/8) do little work per key tile:
# with a full wave and no split, wider tiles read the cache faster (H200, batch 96-165,
# context 900-1200: 85-87 % of copy bandwidth against 81-84 % at 64).
DECODE_BLOCK_N_FEW_HEADS = 128
# Decode programs resident per SM at the tile sizes above (registers and shared memory).
DECODE_PROGRAMS_PER_SM = 4
# (BLOCK_M rows = query tokens x group heads, BLOCK_N keys, warps, stages). float32 runs
# its dots on FMA units and spills at the 16-bit tile sizes.
PREFILL_CONFIG = (64, 64, 4, 3)
PREFILL_CONFIG_FP32 = (32, 16, 8, 2)


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
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [T, Hkv, D] into kv_cache at slot_mapping [T] (negative slots skipped)."""
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
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
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
        **pdl_launch(key),
    )


@triton.jit
def _attend_tile(
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
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _seq_partition(seq_len, num_splits, max_partition, BLOCK_N: tl.constexpr):
    """Keys per split for this request: its own context spread over all the splits, in whole
    tiles and at least DECODE_MIN_PARTITION keys. The grid is sized for the longest context
    (a CUDA graph's for max_model_len), and a shorter one would otherwise leave all but its
    first split idle."""
    part = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.minimum(tl.maximum(part, MIN_PARTITION), max_partition)


# Triton compiles a variant for each divisibility of an integer argument by 16; the split
# count's strides (stride_lb, stride_lh) would make splits of 9 and of 16 two compiles.
@triton.jit(do_not_specialize=["partition_size", "stride_bt", "stride_lb", "stride_lh"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,
    partition_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
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
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, end, m_i, k_cache_ptr, v_cache_ptr, table, kv_head, qk_scale,
            stride_cb, stride_cs, stride_ch,
            HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, MASKED=True, CAUSAL=False,
        )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
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


@triton.jit(do_not_specialize=["stride_bt", "first_req"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
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
    # Keys up to the tile's first query position are visible to every row: those tiles
    # skip the causal mask. Keys past its last query position are masked for every row.
    # Key 0 is visible to every row, so m_i is finite after the first tile.
    unmasked_end = (context_len + q_tile * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    kv_end = context_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    for n0 in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, kv_end, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head,
            qk_scale, stride_cb, stride_cs, stride_ch,
            HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, MASKED=False, CAUSAL=True,
        )  # fmt: skip
    for n0 in range(unmasked_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, kv_end, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head,
            qk_scale, stride_cb, stride_cs, stride_ch,
            HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, MASKED=True, CAUSAL=True,
        )  # fmt: skip

    acc = acc / l_i[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=q_mask)


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


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Context partitions per (request, kv head): about one wave of programs in all.

    A wave is DECODE_PROGRAMS_PER_SM resident programs on every SM. A batch that already
    fills it gains nothing from splitting and pays for the merge; a few long requests
    split until they fill it.
    """
    wave = DECODE_PROGRAMS_PER_SM * num_sms
    programs = max(1, num_seqs * num_kv_heads)
    most = max(1, min(DECODE_MAX_SPLITS, triton.cdiv(max_seq_len, DECODE_MIN_PARTITION)))
    return max(1, min(most, (wave + programs // 2) // programs))


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
    assert kv_cache.dtype == query.dtype, f"kv_cache {kv_cache.dtype} != query {query.dtype}"
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must be contiguous"
    block_size = kv_cache.shape[2]
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} must be a power of two"
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_seqs + 1,), "query_start_loc must be [B + 1]"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, "block_tables [B, M]"
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"


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
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over paged context; returns [T, Hq, D].

    max_query_len / max_seq_len may be upper bounds (CUDA graphs capture with the
    largest). The first `num_decodes` requests have one query token each: in a batch that
    also holds longer queries they take the decode kernel, and the prefill kernel's grid
    covers only the rest (its programs for query tiles past a request's length would
    otherwise be launched for every decode, and its query tiles are mostly empty rows
    for them). num_splits overrides the decode partition count (benchmarks). `out`: a
    contiguous [T, Hq, D] tensor to write into instead of a new one; rows that no request
    owns are left as they are.
    """
    _check_attention_args(query, kv_cache, query_start_loc, seq_lens, block_tables)
    num_tokens = query.shape[0]
    num_seqs = seq_lens.shape[0]
    out = _output(query, out)
    if num_tokens == 0 or num_seqs == 0:
        return out
    args = _KernelArgs(query, kv_cache, out, scale)
    if max_query_len == 1:
        _launch_decode(args, query_start_loc, seq_lens, block_tables, max_seq_len, num_splits)
        return out
    if 0 < num_decodes < num_seqs:
        # Unsplit: beside a prefill the GPU has work enough, and one kernel variant serves
        # every mixed batch (the engine's warm-up compiles it; a split count is a constexpr).
        _launch_decode(
            args,
            query_start_loc[: num_decodes + 1],
            seq_lens[:num_decodes],
            block_tables[:num_decodes],
            max_seq_len,
            num_splits or 1,
        )
    else:
        num_decodes = 0
    _launch_prefill(args, query_start_loc, seq_lens, block_tables, max_query_len, num_decodes)
    return out


def _output(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(query)
    assert out.shape == query.shape and out.dtype == query.dtype, "out must be like query"
    assert out.is_contiguous(), "out must be contiguous"
    return out


class _KernelArgs:
    """What the decode and prefill launches of one attention call share."""

    def __init__(self, query, kv_cache, out, scale):
        self.query, self.out = query, out
        num_heads, head_dim = query.shape[1], query.shape[2]
        self.block_size, self.num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        self.group = num_heads // self.num_kv_heads
        self.num_heads, self.head_dim = num_heads, head_dim
        self.k_cache, self.v_cache = kv_cache[0], kv_cache[1]
        self.block_d = max(16, triton.next_power_of_2(head_dim))
        self.precision = "ieee" if query.dtype == torch.float32 else "tf32"
        self.qk_scale = scale * LOG2E
        k = self.k_cache
        self.cache_strides = (k.stride(0), k.stride(1), k.stride(2))


def decode_split_variants() -> list[int]:
    """A split count for each decode kernel variant: unsplit, then each power of two up to
    DECODE_MAX_SPLITS (the merge's tile over the partials, BLOCK_S, is the count's next
    power of two, a compile-time constant)."""
    return [1] + [1 << k for k in range(1, (DECODE_MAX_SPLITS - 1).bit_length() + 1)]


def warm_up_decode(kv_cache: torch.Tensor, num_heads: int, scale: float) -> None:
    """Compile every decode kernel variant for this cache's shape now. Steps without CUDA
    graphs (enforce_eager, pipeline stages) pick the split count from the batch and its
    longest context, and would otherwise compile the variants one by one while serving."""
    device, head_dim = kv_cache.device, kv_cache.shape[4]
    query = torch.zeros(1, num_heads, head_dim, dtype=kv_cache.dtype, device=device)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    block_tables = torch.zeros(1, 1, dtype=torch.int32, device=device)  # the null block
    for splits in decode_split_variants():
        paged_attention_triton(
            query, kv_cache, query_start_loc, seq_lens, block_tables, scale, 1, 1,
            num_splits=splits,
        )  # fmt: skip


def _launch_decode(a, query_start_loc, seq_lens, block_tables, max_seq_len, num_splits):
    query, out = a.query, a.out
    num_seqs = seq_lens.shape[0]
    if num_splits is None:
        num_sms = _num_sms(query.device.index or 0) if query.is_cuda else 132
        num_splits = decode_num_splits(num_seqs, a.num_kv_heads, max_seq_len, num_sms)
    block_g = max(16, triton.next_power_of_2(a.group))
    block_n, num_warps = DECODE_BLOCK_N, DECODE_NUM_WARPS
    if block_g >= 32:
        # Many query rows per program (MQA-like groups): more warps, and float32 tiles
        # small enough not to spill.
        num_warps = 8
        block_n = 32 if query.dtype == torch.float32 else block_n
    elif a.group <= 2 and num_splits == 1 and query.dtype != torch.float32:
        block_n = DECODE_BLOCK_N_FEW_HEADS
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
        BLOCK_G=block_g,
        BLOCK_D=a.block_d,
        BLOCK_N=block_n,
        BLOCK_SIZE=a.block_size,
        BLOCK_S=triton.next_power_of_2(num_splits),
        SINGLE_SPLIT=single,
        DOT_PRECISION=a.precision,
        **pdl_launch(query),
        num_warps=num_warps,
        num_stages=DECODE_NUM_STAGES,
    )


def prefill_block_m(max_query_len: int, group: int, float32: bool) -> int:
    """Rows of a prefill tile (query tokens x the group's heads): small tiles when every
    query of the batch is short (decodes mixed with short chunks)."""
    max_m = (PREFILL_CONFIG_FP32 if float32 else PREFILL_CONFIG)[0]
    block_m = max(16, min(max_m, triton.next_power_of_2(max_query_len * group)))
    return max(block_m, triton.next_power_of_2(group))


def prefill_tile_query_lens(group: int, float32: bool) -> list[int]:
    """The shortest longest-query (of 2 tokens or more) that takes each prefill tile size.
    Each size is a Triton compile of its own; a warm-up that runs a prefill of each of
    these lengths leaves none to compile while serving."""
    lens: dict[int, int] = {}
    largest = prefill_block_m(1 << 20, group, float32)
    length = 2
    while largest not in lens:
        lens.setdefault(prefill_block_m(length, group, float32), length)
        length += 1
    return sorted(lens.values())


def _launch_prefill(a, query_start_loc, seq_lens, block_tables, max_query_len, first_req):
    """Requests first_req.. of the batch. An index rather than sliced tensors: Triton
    specializes a kernel on each pointer's 16-byte alignment, and slices at every decode
    count would compile it again and again during serving."""
    query, out = a.query, a.out
    float32 = query.dtype == torch.float32
    _, block_n, num_warps, num_stages = PREFILL_CONFIG_FP32 if float32 else PREFILL_CONFIG
    block_m = prefill_block_m(max_query_len, a.group, float32)
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
        **pdl_launch(query),
        num_warps=num_warps,
        num_stages=num_stages,
    )


__all__ = [
    "decode_num_splits",
    "decode_split_variants",
    "paged_attention_triton",
    "prefill_block_m",
    "prefill_tile_query_lens",
    "store_kv_triton",
    "warm_up_decode",
]
