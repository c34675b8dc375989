"""One-row WOQ products (batch-1 decode): y [1, N] = x [1, K] @ W.T, W dequantized in
registers.

Each program owns BLOCK_N rows and walks K in tiles of BLOCK_C chunks; a chunk is the 16
bytes of a row that one thread loads at once: CHUNK = 128 // bits inputs. A thread owns
one chunk (or more, never less: see triton_woq.MIN_CHUNKS_A_WARP) of every row of the
program, and its CHUNK inputs of x, read once, serve all BLOCK_N rows. A chunk holds SUB pieces of min(G, CHUNK) inputs, each inside one group. Per
piece and row the codes' dot with x runs in float32 in the thread, on the magic floats of
common.py; the group's scale multiplies that sum once, and the min meets the piece's sum
of x:

    sum_k x_k (q_k s + m) = s * (sum_k x_k (off_k + q_k) - sum_k off_k x_k) + m * sum_k x_k

The next tile's weights are loaded while this one is computed (the last tile is computed
after the loop, so a one-tile program loads nothing twice), and the first tile before the
kernel waits on the one before it (kernels.pdl): weights are never written. Layers of
whole tiles and row blocks (EVEN) take no masks. With split-K
(narrow layers: too few programs to fill the GPU) the programs of a row block write float32
partials, and the last to finish (a counter per row block) adds them up.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.pdl import wait_for_previous_kernel
from kernels.triton_woq.common import join_codes, unpack_words


@triton.jit
def _weight_tile(
    w_ptrs, s_ptrs, m_ptrs, w_row_ok, s_row_ok, k0, k_end,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    """Words [BLOCK_N, BLOCK_C, 4] and scale, min [BLOCK_N, BLOCK_C, pieces a chunk] of the
    tile at input k0; zeros past k_end and the last row (unless EVEN:
    whole tiles and row blocks, no masks)."""
    CHUNK: tl.constexpr = 128 // BITS
    w_ptrs += k0 * BITS // 32
    s_ptrs += k0 // GROUP
    m_ptrs += k0 // GROUP
    # Scales come as [BLOCK_C, SUB, BLOCK_N] and are permuted below: loaded so, each thread
    # holds every row of its chunk, as with the weights (no shuffle between the two).
    if EVEN:
        words = tl.load(w_ptrs, eviction_policy="evict_first")
        s = tl.load(s_ptrs)
        m = tl.load(m_ptrs)
    else:
        # By whole chunks: a mask constant over each 16-byte run keeps the loads 16 bytes.
        chunk_of_word = tl.arange(0, BLOCK_C * 4) // 4
        w_ok = w_row_ok & (k0 + chunk_of_word[None, :] * CHUNK < k_end)
        words = tl.load(w_ptrs, mask=w_ok, other=0, eviction_policy="evict_first")
        g_ok = s_row_ok & (k0 + tl.arange(0, BLOCK_C)[:, None, None] * CHUNK < k_end)
        s = tl.load(s_ptrs, mask=g_ok, other=0.0)
        m = tl.load(m_ptrs, mask=g_ok, other=0.0)
    return words.reshape(BLOCK_N, BLOCK_C, 4), tl.permute(s, (2, 0, 1)), tl.permute(m, (2, 0, 1))


@triton.jit
def _x_tile(x_ptr, k0, k_end, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, EVEN: tl.constexpr):
    """x [BLOCK_C, CHUNK] as float32 from input k0, a whole chunk in each thread (loaded as
    16-byte runs, 3-D so that the runs of a chunk stay in one thread); zeros past k_end."""
    chunks = tl.arange(0, BLOCK_C)[:, None, None]
    ok = k0 + chunks * CHUNK < k_end
    if x_ptr.dtype.element_ty == tl.bfloat16:
        # bfloat16 pairs as int32: a bfloat16 is the top half of its float32.
        offs = chunks * (CHUNK // 2) + tl.arange(0, CHUNK // 8)[None, :, None] * 4
        offs += tl.arange(0, 4)[None, None, :]
        ptrs = x_ptr.to(tl.pointer_type(tl.int32)) + k0 // 2 + offs
        pairs = tl.load(ptrs) if EVEN else tl.load(ptrs, mask=ok, other=0)
        even = (pairs << 16).to(tl.float32, bitcast=True)
        odd = (pairs & -65536).to(tl.float32, bitcast=True)
        x = tl.join(even, odd)
    else:
        offs = chunks * CHUNK + tl.arange(0, CHUNK // 8)[None, :, None] * 8
        offs += tl.arange(0, 8)[None, None, :]
        x = tl.load(x_ptr + k0 + offs) if EVEN else tl.load(x_ptr + k0 + offs, mask=ok, other=0.0)
        x = x.to(tl.float32)
    return x.reshape(BLOCK_C, CHUNK)


@triton.jit
def _tile_dot(words, s, m, x, magic_lo, magic_hi, BITS: tl.constexpr, GROUP: tl.constexpr):
    """[BLOCK_N, BLOCK_C, SUB]: each row's product with x over each piece of the tile."""
    CHUNK: tl.constexpr = 128 // BITS
    PIECE: tl.constexpr = GROUP if GROUP < CHUNK else CHUNK
    SUB: tl.constexpr = CHUNK // PIECE
    block_n: tl.constexpr = words.shape[0]
    block_c: tl.constexpr = words.shape[1]
    lo, hi = unpack_words(words, magic_lo, magic_hi, BITS)
    q = join_codes(lo, hi, BITS).reshape(block_n, block_c, CHUNK)
    # Even and odd inputs in two sums: shorter float32 chains, and 4-bit codes carry a
    # different offset at each parity.
    d = tl.sum((q * x[None, :, :]).reshape(block_n, block_c, SUB, PIECE // 2, 2), 3)
    d_even, d_odd = tl.split(d)
    x_even, x_odd = tl.split(tl.sum(x.reshape(block_c, SUB, PIECE // 2, 2), 2))
    if BITS == 4:
        offsets = 256.0 * x_even + 16.0 * x_odd
    else:
        offsets = 256.0 * (x_even + x_odd)
    s = s.to(tl.float32)
    return (
        s * (d_even + d_odd - offsets[None, :, :]) + m.to(tl.float32) * (x_even + x_odd)[None, :, :]
    )


@triton.jit
def _store_rows(y, rows, b_ptr, y_ptr, N, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


# Split counts and the tiles a split takes change with the layer's shape: left
# unspecialized so that they do not multiply the compiled variants.
@triton.jit(do_not_specialize=["tiles_per_split"])
def woq_gemv_kernel(
    x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, y_ptr, part_ptr, counter_ptr,
    N, K, stride_w, stride_s, tiles_per_split, magic_lo, magic_hi,
    BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    CHUNK: tl.constexpr = 128 // BITS
    PIECE: tl.constexpr = GROUP if GROUP < CHUNK else CHUNK
    SUB: tl.constexpr = CHUNK // PIECE
    TILE: tl.constexpr = BLOCK_C * CHUNK
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_start = pid_k * tiles_per_split * TILE
    k_end = tl.minimum(K, k_start + tiles_per_split * TILE)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + tl.arange(0, BLOCK_C * 4)[None, :]
    # [BLOCK_C, SUB, BLOCK_N]: the group of each piece, of each row
    pieces = tl.arange(0, BLOCK_C)[:, None, None] * SUB + tl.arange(0, SUB)[None, :, None]
    s_offs = rows[None, None, :].to(tl.int64) * stride_s + (pieces * PIECE) // GROUP
    tile_args = (w_ptrs, s_ptr + s_offs, m_ptr + s_offs, rows[:, None] < N, rows[None, None, :] < N)

    words, s, m = _weight_tile(*tile_args, k_start, k_end, BITS, GROUP, BLOCK_N, BLOCK_C, EVEN)
    wait_for_previous_kernel(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_C, SUB], tl.float32)
    # Every tile but the last loads the next one before computing its own; the last tile
    # is computed after the loop (a layer of one tile loads nothing twice).
    k_last = k_start + (tl.cdiv(k_end - k_start, TILE) - 1) * TILE
    for k0 in range(k_start, k_last, TILE):
        x = _x_tile(x_ptr, k0, k_end, CHUNK, BLOCK_C, EVEN)
        next_words, next_s, next_m = _weight_tile(
            *tile_args, k0 + TILE, k_end, BITS, GROUP, BLOCK_N, BLOCK_C, EVEN
        )
        acc += _tile_dot(words, s, m, x, magic_lo, magic_hi, BITS, GROUP)
        words, s, m = next_words, next_s, next_m
    x = _x_tile(x_ptr, k_last, k_end, CHUNK, BLOCK_C, EVEN)
    acc += _tile_dot(words, s, m, x, magic_lo, magic_hi, BITS, GROUP)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)

    if not SPLIT:
        _store_rows(y, rows, b_ptr, y_ptr, N, HAS_BIAS)
    else:
        num_splits = tl.num_programs(1)
        tl.store(part_ptr + pid_k * N + rows, y, mask=rows < N)
        # Every thread's partial store comes before the counter's release; the program
        # that takes the count to num_splits sees all of them (acquire) and adds them up.
        tl.debug_barrier()
        counter = counter_ptr + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(counter, 0)  # ready for the next launch (graph replays reuse it)
            splits = tl.arange(0, BLOCK_S)
            parts = tl.load(
                part_ptr + splits[:, None] * N + rows[None, :],
                mask=(splits[:, None] < num_splits) & (rows[None, :] < N),
                other=0.0,
                cache_modifier=".cg",  # the other SMs' partials, from L2
            )
            _store_rows(tl.sum(parts, axis=0), rows, b_ptr, y_ptr, N, HAS_BIAS)
