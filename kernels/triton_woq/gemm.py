"""WOQ products of several rows on tensor cores, and the dequantization that larger
batches hand to cuBLAS.

`woq_gemm_kernel` computes y [M, N] = x [M, K] @ W.T tile by tile: the weight tile
[BLOCK_N, BLOCK_K] is dequantized in registers (q * s + m in float32, rounded to x's
dtype, as the layout defines the weight) and stored to shared memory as the dot's second
operand, which Hopper's wgmma reads from there (as the first operand from registers it
would be moved through shared memory and back). The wgmma takes 64 rows of x at least, so a
decode batch of a few rows leaves most of them masked: the tensor cores have time to
spare, the dequantization is the work. A tile's programs for successive row blocks of x
are launched next to each other and share its weights through L2. Split-K (too few tiles
to fill the GPU) writes float32 partials that the last program of a tile adds up, as the
GEMV does.

`woq_dequant_kernel` writes the whole weight in x's dtype; a large batch then runs one
cuBLAS GEMM, faster than dequantizing every tile once per row block of x.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.pdl import wait_for_previous_kernel
from kernels.triton_woq.common import dequantize_words


@triton.jit
def _weight_tile(
    w_ptr, s_ptr, m_ptr, rows, N, k0, k_end, stride_w, stride_s, magic_lo, magic_hi,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    """The weights [len(rows), BLOCK_K] at input k0 as DTYPE; zeros past k_end and N
    (unless EVEN: whole tiles, no masks)."""
    PW: tl.constexpr = 32 // BITS
    NG: tl.constexpr = BLOCK_K // GROUP
    cols = k0 // PW + tl.arange(0, BLOCK_K // PW)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :]
    groups = k0 // GROUP + tl.arange(0, NG)
    g_offs = rows[:, None].to(tl.int64) * stride_s + groups[None, :]
    if EVEN:
        words = tl.load(w_ptrs)
        s = tl.load(s_ptr + g_offs)
        m = tl.load(m_ptr + g_offs)
    else:
        row_ok = rows[:, None] < N
        words = tl.load(w_ptrs, mask=row_ok & (cols[None, :] < k_end // PW), other=0)
        g_ok = row_ok & (groups[None, :] < k_end // GROUP)
        s = tl.load(s_ptr + g_offs, mask=g_ok, other=0.0)
        m = tl.load(m_ptr + g_offs, mask=g_ok, other=0.0)
    s = s.to(tl.float32)
    m = m.to(tl.float32)
    words = words.reshape(rows.shape[0], NG, GROUP // PW)
    return dequantize_words(words, s[:, :, None], m[:, :, None], magic_lo, magic_hi, BITS, DTYPE)


@triton.jit(do_not_specialize=["M", "tiles_per_split"])
def woq_gemm_kernel(
    x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, y_ptr, part_ptr, counter_ptr,
    M, N, K, stride_xm, stride_w, stride_s, stride_ym, tiles_per_split, magic_lo, magic_hi,
    BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    toks = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    k_start = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(K, k_start + tiles_per_split * BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + toks[:, None].to(tl.int64) * stride_xm + ks[None, :]
    tok_ok = toks[:, None] < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x_ok = tok_ok if EVEN else tok_ok & (k0 + ks[None, :] < k_end)
        x = tl.load(x_ptrs + k0, mask=x_ok, other=0.0)
        w = _weight_tile(
            w_ptr, s_ptr, m_ptr, rows, N, k0, k_end, stride_w, stride_s, magic_lo, magic_hi,
            BITS, GROUP, BLOCK_K, x_ptr.dtype.element_ty, EVEN,
        )  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc)

    out_ok = tok_ok & (rows[None, :] < N)
    out_offs = toks[:, None].to(tl.int64) * stride_ym + rows[None, :]
    if SPLIT:
        num_splits = tl.num_programs(2)
        part_offs = toks[:, None].to(tl.int64) * N + rows[None, :]
        tl.store(part_ptr + pid_k * M * N + part_offs, acc, mask=out_ok)
        tl.debug_barrier()  # all partial stores before the release (see gemv.py)
        counter = counter_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(counter, 0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for split in range(num_splits):
                acc += tl.load(
                    part_ptr + split * M * N + part_offs,
                    mask=out_ok,
                    other=0.0,
                    cache_modifier=".cg",
                )
            if HAS_BIAS:
                acc += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def woq_dequant_kernel(
    w_ptr, s_ptr, m_ptr, out_ptr, N, K, stride_w, stride_s, stride_o, magic_lo, magic_hi,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = _weight_tile(
        w_ptr, s_ptr, m_ptr, rows, N, k0, K, stride_w, stride_s, magic_lo, magic_hi,
        BITS, GROUP, BLOCK_K, out_ptr.dtype.element_ty, EVEN,
    )  # fmt: skip
    ks = k0 + tl.arange(0, BLOCK_K)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_o + ks[None, :]
    if EVEN:
        tl.store(out_ptrs, w)
    else:
        tl.store(out_ptrs, w, mask=(rows[:, None] < N) & (ks[None, :] < K))
