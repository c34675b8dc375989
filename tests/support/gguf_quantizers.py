"""Round-to-nearest GGUF quantizers writing llama.cpp's raw blocks, for tests.

gguf-py quantizes Q4_0, Q4_1, Q5_0 and Q8_0; the K-quants (Q4_K, Q5_K, Q6_K) are written here from
their block layouts (llama.cpp's ggml-common.h), by plain rounding rather than llama.cpp's
error-minimising search: the blocks are valid, only less accurate than llama.cpp's own.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

QK_K = 256
K_QUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)


def quantize_gguf(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float [N, K] -> uint8 [N, K // block_size * type_size], the blocks GGUFReader reads."""
    w = np.asarray(w, dtype=np.float32)
    if qtype not in K_QUANTS:
        return quantize(w, qtype)  # gguf-py's own (Q4_0, Q4_1, Q5_0, Q8_0, ...)
    if w.ndim != 2 or w.shape[1] % QK_K:
        raise ValueError(f"w must be [N, K] with K a multiple of {QK_K}, got {list(w.shape)}")
    rows, num_blocks = w.shape[0], w.shape[1] // QK_K
    blocks = w.reshape(rows, num_blocks, QK_K)
    if qtype == GGMLQuantizationType.Q4_K:
        out = _quantize_q4_k_or_q5_k(blocks, levels=15)
    elif qtype == GGMLQuantizationType.Q5_K:
        out = _quantize_q4_k_or_q5_k(blocks, levels=31)
    else:
        out = _quantize_q6_k(blocks)
    return out.reshape(rows, -1)


def _half_bytes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., 1] -> (its float16 rounding as float32, its 2 bytes)."""
    half = np.ascontiguousarray(x.astype(np.float16))
    return half.astype(np.float32), half.view(np.uint8)


def _rounded_ratio(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(scale == 0, 0, np.rint(x / scale))


def _quantize_q4_k_or_q5_k(blocks: np.ndarray, levels: int) -> np.ndarray:
    """Eight sub-blocks of 32 values, each w = d*sc * q - dmin*m with q in 0..levels and
    6-bit sc, m; d and dmin float16 per super-block."""
    x = blocks.reshape(*blocks.shape[:2], 8, 32)
    low = np.minimum(x.min(axis=-1), 0)  # llama.cpp keeps the offset at or below zero
    sub_scale = (x.max(axis=-1) - low) / levels
    d, d_bytes = _half_bytes(sub_scale.max(axis=-1, keepdims=True) / 63)
    dmin, dmin_bytes = _half_bytes((-low).max(axis=-1, keepdims=True) / 63)
    sc = np.clip(_rounded_ratio(sub_scale, d), 0, 63).astype(np.uint8)
    m = np.clip(_rounded_ratio(-low, dmin), 0, 63).astype(np.uint8)
    step, offset = (d * sc)[..., None], (dmin * m)[..., None]
    q = np.clip(_rounded_ratio(x + offset, step), 0, levels).astype(np.uint8)

    # Scales 0-3 and mins 0-3 in the low 6 bits of bytes 0-7; scales and mins 4-7 split
    # into a low nibble (bytes 8-11) and 2 top bits (top of bytes 0-3 and 4-7).
    packed = np.concatenate(
        (
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ),
        axis=-1,
    )
    pairs = (q & 0x0F).reshape(*q.shape[:2], 4, 2, 32)  # sub-blocks 2c and 2c+1 share bytes
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*q.shape[:2], 128)
    fields = [d_bytes, dmin_bytes, packed]
    if levels == 31:  # bit j of byte i: the fifth bit of value i of sub-block j
        fifth = (q >> 4).astype(np.uint16) << np.arange(8, dtype=np.uint16)[:, None]
        fields.append(fifth.sum(axis=-2).astype(np.uint8))
    return np.concatenate([*fields, qs], axis=-1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Sixteen sub-blocks of 16 values, each w = d*sc * (q - 32) with q in 0..63 and signed
    8-bit sc; d float16 per super-block."""
    x = blocks.reshape(*blocks.shape[:2], 16, 16)
    # The signed scale maps each sub-block's largest magnitude to -32 (as llama.cpp does).
    extreme = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    sub_scale = extreme / -32
    d, d_bytes = _half_bytes(np.abs(sub_scale).max(axis=-1, keepdims=True) / 127)
    sc = np.clip(_rounded_ratio(sub_scale, d), -128, 127).astype(np.int8)
    step = (d * sc)[..., None]
    q = (np.clip(_rounded_ratio(x, step), -32, 31) + 32).astype(np.uint8)

    # Per half of 128 values, quarter k holds values 32k..32k+31: quarters 0 and 2 share
    # bytes 0-31 of the low nibbles (0 in the low half), 1 and 3 bytes 32-63; byte i of the
    # 32 high bytes holds the top 2 bits of value i of quarter k at bits 2k, 2k+1.
    quarters = q.reshape(*q.shape[:2], 2, 4, 32)
    low = quarters & 0x0F
    ql = np.concatenate(
        (low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)), axis=-1
    )
    top = (quarters >> 4).astype(np.uint16) << (2 * np.arange(4, dtype=np.uint16))[:, None]
    qh = top.sum(axis=-2).astype(np.uint8)
    return np.concatenate(
        (
            ql.reshape(*q.shape[:2], 128),
            qh.reshape(*q.shape[:2], 64),
            sc.view(np.uint8).reshape(*q.shape[:2], 16),
            d_bytes,
        ),
        axis=-1,
    )
