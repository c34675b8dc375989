"""GGUF tensors kept quantized: llama.cpp blocks repacked into the WOQ layout.

The WOQ layout (docs in kernels/woq_ref.py): uint8 `qweight` [N, K * bits // 8] (bits 4: two
values a byte, the even column in the low nibble), float16 `scales` and `mins` [N, K // G],
w = q * scale + min. What each GGUF type becomes:

    Q4_0  d * (q - 8)            -> 4 bits, G 32, scale d,            min -8 d
    Q4_1  d * q + m              -> 4 bits, G 32, scale d,            min m
    Q8_0  d * q, q int8          -> 8 bits, G 32, q + 128, scale d,   min -128 d
    Q4_K  d*sc * q - dmin*m      -> 4 bits, G 32, scale d*sc,         min -dmin*m
    Q5_K  as Q4_K, q in 0..31    -> 8 bits, G 32
    Q6_K  d*sc * (q - 32)        -> 8 bits, G 16, scale d*sc,         min -32 scale

Q4_0, Q4_1 and Q8_0 keep their float16 factors, so the WOQ weights equal gguf-py's `dequantize`
exactly. The K-quants multiply a float16 super-block factor by a 6- or 8-bit sub-block one;
that product is rounded to float16 here, so a weight differs from gguf-py's by at most
2^-11 * (q * |scale| + |min|) (plus 2^-25 per factor where it is a float16 subnormal): a
fraction (q_max + |min| / scale) / 2048 of a quantization step for Q4_K and Q5_K, and at most
1/64 of a step for Q6_K (its min is -32 times the rounded scale, so only the scale rounds).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256
"""Values in a K-quant super-block."""

WOQ_FORMATS: dict[GGMLQuantizationType, tuple[int, int]] = {
    GGMLQuantizationType.Q4_0: (4, 32),
    GGMLQuantizationType.Q4_1: (4, 32),
    GGMLQuantizationType.Q4_K: (4, 32),
    GGMLQuantizationType.Q8_0: (8, 32),
    GGMLQuantizationType.Q5_K: (8, 32),
    GGMLQuantizationType.Q6_K: (8, 16),
}
"""(bits, group_size) of the GGUF types kept quantized."""

_FLOAT16_MAX = 65504.0


class WoqParts(NamedTuple):
    """One linear weight in the WOQ layout."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bits: int
    group_size: int


def woq_format(tensor_type: GGMLQuantizationType | int) -> tuple[int, int] | None:
    """(bits, group_size) a tensor of this GGUF type is kept at; None where it is not kept
    quantized (F32/F16/BF16 stay float; other quantized types are dequantized)."""
    return WOQ_FORMATS.get(GGMLQuantizationType(tensor_type))


def repack_gguf_tensor(data: np.ndarray, tensor_type: GGMLQuantizationType | int) -> WoqParts:
    """The WOQ parts of a 2-D GGUF tensor from its raw block bytes.

    data: uint8 [N, K // block_size * type_size], as GGUFReader's `tensor.data` (row n holds
    output channel n's blocks); tensor_type: its `tensor.tensor_type`.
    """
    tensor_type = GGMLQuantizationType(tensor_type)
    if tensor_type not in _UNPACKERS:
        raise ValueError(f"tensor_type {tensor_type.name} is not kept quantized")
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] % type_size:
        raise ValueError(
            f"data must be uint8 [rows, whole {tensor_type.name} blocks of {type_size} bytes], "
            f"got {data.dtype} {list(data.shape)}"
        )
    rows, num_blocks = data.shape[0], data.shape[1] // type_size
    q, scales, mins = _UNPACKERS[tensor_type](data.reshape(rows, num_blocks, type_size))
    bits, group_size = WOQ_FORMATS[tensor_type]
    q = q.reshape(rows, num_blocks * block_size)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << np.uint8(4))
    return WoqParts(
        torch.from_numpy(np.ascontiguousarray(q)),
        torch.from_numpy(_to_float16(scales.reshape(rows, -1), "scales", tensor_type)),
        torch.from_numpy(_to_float16(mins.reshape(rows, -1), "mins", tensor_type)),
        bits,
        group_size,
    )


def widen_woq(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bits: int,
    group: int,
    to_bits: int,
    to_group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same weights at more bits and/or a smaller group (exact): 4-bit values move to a
    byte each, and each group's scale and min repeat over its group // to_group subgroups.
    Used to store the shards of a fused layer (q/k/v, gate/up) at one common format."""
    if bits not in (4, 8) or to_bits not in (4, 8) or to_bits < bits:
        raise ValueError(f"to_bits must be 4 or 8 and at least bits={bits}, got {to_bits}")
    if to_group <= 0 or group % to_group:
        raise ValueError(f"to_group must divide group={group}, got {to_group}")
    if to_bits != bits:
        qweight = torch.stack((qweight & 0x0F, qweight >> 4), dim=-1).flatten(-2)
    if to_group != group:
        scales = scales.repeat_interleave(group // to_group, dim=-1)
        mins = mins.repeat_interleave(group // to_group, dim=-1)
    return qweight, scales, mins


def common_woq_format(formats: Iterable[tuple[int, int] | None]) -> tuple[int, int] | None:
    """The format a fused layer stores its shards at: the most bits and the smallest group
    of its shards' formats; None (the layer stays float) when any shard is not quantized."""
    formats = list(formats)
    if not formats or any(f is None for f in formats):
        return None
    bits = max(b for b, _ in formats)
    group = min(g for _, g in formats)
    if any(g % group for _, g in formats):
        raise ValueError(f"group sizes {sorted({g for _, g in formats})} have no common divisor")
    return bits, group


def _to_float16(x: np.ndarray, field: str, tensor_type: GGMLQuantizationType) -> np.ndarray:
    if np.abs(x).max(initial=0.0) > _FLOAT16_MAX:
        raise ValueError(f"{field} of a {tensor_type.name} tensor exceed the float16 range")
    return np.ascontiguousarray(x.astype(np.float16))


def _half(b: np.ndarray) -> np.ndarray:
    """Float16 fields [..., 2] bytes -> float32 [..., 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2, n]: the low nibbles, then the high ones."""
    return np.stack((b & np.uint8(0x0F), b >> np.uint8(4)), axis=-2)


# Each unpacker: blocks uint8 [rows, blocks, type_size] -> (q uint8 [rows, blocks, values],
# scales and mins float32 [rows, blocks, groups]), in the order the values appear.


def _unpack_q4_0(blocks):
    d = _half(blocks[..., 0:2])
    q = _nibbles(blocks[..., 2:18]).reshape(*blocks.shape[:2], 32)
    return q, d, -8 * d


def _unpack_q4_1(blocks):
    q = _nibbles(blocks[..., 4:20]).reshape(*blocks.shape[:2], 32)
    return q, _half(blocks[..., 0:2]), _half(blocks[..., 2:4])


def _unpack_q8_0(blocks):
    d = _half(blocks[..., 0:2])
    return blocks[..., 2:34] ^ np.uint8(0x80), d, -128 * d  # int8 bits + 128 as uint8


def _k_scales_and_mins(blocks):
    """The 8 six-bit sub-block scales and mins of a Q4_K/Q5_K super-block times d / dmin.

    Their 12 bytes: bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; bytes
    8-11 hold the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top
    2 bits sit in the top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    packed = blocks[..., 4:16]
    low_sc, low_m, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((low_sc & 0x3F, (rest & 0x0F) | ((low_sc >> 6) << 4)), axis=-1)
    m = np.concatenate((low_m & 0x3F, (rest >> 4) | ((low_m >> 6) << 4)), axis=-1)
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _k_low_nibbles(qs):
    """Q4_K/Q5_K quants [..., 128] -> [..., 8, 32]: each 32 bytes hold two sub-blocks, the
    first in the low nibbles."""
    return _nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).reshape(*qs.shape[:-1], 8, 32)


def _unpack_q4_k(blocks):
    scales, mins = _k_scales_and_mins(blocks)
    return _k_low_nibbles(blocks[..., 16:144]), scales, mins


def _unpack_q5_k(blocks):
    scales, mins = _k_scales_and_mins(blocks)
    qh = blocks[..., 16:48]  # bit j of byte i: the fifth bit of value i of sub-block j
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)
    return _k_low_nibbles(blocks[..., 48:176]) | (high << np.uint8(4)), scales, mins


def _unpack_q6_k(blocks):
    rows, num_blocks = blocks.shape[:2]
    # Each half of 128 values: 64 bytes of low nibbles (values 0-63, then 64-127) and 32
    # bytes of 2-bit pairs (pair p of byte i: the top 2 bits of value 32 p + i).
    low = _nibbles(blocks[..., 0:128].reshape(rows, num_blocks, 2, 64))
    qh = blocks[..., 128:192].reshape(rows, num_blocks, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & np.uint8(3)
    q = low.reshape(rows, num_blocks, 256) | (high.reshape(rows, num_blocks, 256) << 4)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    scales = _half(blocks[..., 208:210]) * sc
    # Scaling the rounded scale by -32 keeps min = -32 scale exact in float16.
    with np.errstate(over="ignore"):  # scales out of float16's range are refused after this
        mins = -32 * scales.astype(np.float16).astype(np.float32)
    return q, scales, mins


_UNPACKERS = {
    GGMLQuantizationType.Q4_0: _unpack_q4_0,
    GGMLQuantizationType.Q4_1: _unpack_q4_1,
    GGMLQuantizationType.Q8_0: _unpack_q8_0,
    GGMLQuantizationType.Q4_K: _unpack_q4_k,
    GGMLQuantizationType.Q5_K: _unpack_q5_k,
    GGMLQuantizationType.Q6_K: _unpack_q6_k,
}
