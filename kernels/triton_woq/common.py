"""What the WOQ kernels share: turning packed codes into float32 without int-to-float
conversions, and the split-K counters.

The codes are read as int32 words straight from the layout's uint8 rows (kernels/woq_ref.py;
a little-endian word w of a row holds codes 8w..8w+7 for 4 bits, 4w..4w+3 for 8 bits, field
i in bits [b*i, b*(i+1))). An int-to-float conversion issues at an eighth of the FMA rate,
slower than 4-bit weights stream in, so each code is moved into the mantissa of a float32
whose exponent makes it an offset plus the code: (bits & mask) | magic, one LOP3 with the
magic held in a register. Each of four shifts (left 15, left 7, right 1, right 9) puts one
code at bit 15 (value 256 + q) and, for 4 bits, the next at bit 19 (value 16 + q): four
shifts serve the eight codes (or four bytes) of a word.
The offsets are taken out once per group (the GEMV) or folded into the dequantization's
additive term (the GEMM): w = q * s + m = (256 + q) * s + (m - 256 * s).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Passed as kernel arguments, not constants: in a register, mask-and-or is one LOP3 (two
# immediates would take two instructions).
MAGIC_LO = (127 + 8) << 23  # float32 exponent of 256: code at bit 15 -> 256 + q
MAGIC_HI = (127 + 4) << 23  # float32 exponent of 16: code at bit 19 -> 16 + q


@triton.jit
def _code(bits, mask: tl.constexpr, magic):
    return ((bits & mask) | magic).to(tl.float32, bitcast=True)


@triton.jit
def _interleave4(t):
    """(t0, t1, t2, t3) -> [..., 2, 2] holding t0, t1, t2, t3 in flattened order: tl.join
    adds its axis last, so the first join pairs the values two apart."""
    return tl.join(tl.join(t[0], t[2]), tl.join(t[1], t[3]))


@triton.jit
def unpack_words(words, magic_lo, magic_hi, BITS: tl.constexpr):
    """int32 words [..., W] -> four pairs (lo, hi) of float32 [..., W]: shift j's codes.

    4 bits: lo_j = 256 + code 2j, hi_j = 16 + code 2j+1 of each word. 8 bits: lo_j = 256 +
    byte j (hi_j unused). Shifts are arithmetic; the masks drop the sign bits."""
    shifted = (words << 15, words << 7, words >> 1, words >> 9)
    if BITS == 4:
        LO: tl.constexpr = 0xF << 15
        HI: tl.constexpr = 0xF << 19
        lo = (
            _code(shifted[0], LO, magic_lo),
            _code(shifted[1], LO, magic_lo),
            _code(shifted[2], LO, magic_lo),
            _code(shifted[3], LO, magic_lo),
        )
        hi = (
            _code(shifted[0], HI, magic_hi),
            _code(shifted[1], HI, magic_hi),
            _code(shifted[2], HI, magic_hi),
            _code(shifted[3], HI, magic_hi),
        )
    else:
        BYTE: tl.constexpr = 0xFF << 15
        lo = (
            _code(shifted[0], BYTE, magic_lo),
            _code(shifted[1], BYTE, magic_lo),
            _code(shifted[2], BYTE, magic_lo),
            _code(shifted[3], BYTE, magic_lo),
        )
        hi = lo
    return lo, hi


@triton.jit
def join_codes(lo, hi, BITS: tl.constexpr):
    """The pairs of `unpack_words` (or values computed from them) -> [..., W, 2, 2(, 2)]:
    flattened, the last axes count the codes of a word in the layout's order. The new axes
    are in-thread, so the caller's reshape moves no data."""
    if BITS == 4:
        codes = tl.join(_interleave4(lo), _interleave4(hi))  # code 2j: lo[j]; 2j+1: hi[j]
    else:
        codes = _interleave4(lo)
    return codes


@triton.jit
def dequantize_words(words, s, m, magic_lo, magic_hi, BITS: tl.constexpr, DTYPE: tl.constexpr):
    """words [R, NG, WPG] (groups of WPG words), s and m float32 [R, NG, 1] -> the weights
    [R, NG * WPG * 32 // BITS] as DTYPE: q * s + m in float32, then rounded."""
    lo, hi = unpack_words(words, magic_lo, magic_hi, BITS)
    c_lo = m - 256.0 * s
    c_hi = m - 16.0 * s
    lo = (
        (lo[0] * s + c_lo).to(DTYPE),
        (lo[1] * s + c_lo).to(DTYPE),
        (lo[2] * s + c_lo).to(DTYPE),
        (lo[3] * s + c_lo).to(DTYPE),
    )
    if BITS == 4:
        hi = (
            (hi[0] * s + c_hi).to(DTYPE),
            (hi[1] * s + c_hi).to(DTYPE),
            (hi[2] * s + c_hi).to(DTYPE),
            (hi[3] * s + c_hi).to(DTYPE),
        )
    else:
        hi = lo
    w = join_codes(lo, hi, BITS)
    return w.reshape(words.shape[0], words.shape[1] * words.shape[2] * (32 // BITS))


_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, needed: int) -> torch.Tensor:
    """Zeroed int32 counters for the split-K kernels, kept per device: the program that
    merges a tile's splits sets its counter back to zero, so graph replays reuse them.
    Every launch asks (needed 0 without splits), so the first, outside any capture,
    allocates them; the default size covers every split launch of the default configs
    (a split launch has fewer than a few programs a SM). Grown only outside a
    CUDA-graph capture."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("WOQ split-K counters must be sized before a graph capture")
        counters = torch.zeros(max(needed, 1 << 14), dtype=torch.int32, device=device)
        _counters[device] = counters
    return counters
