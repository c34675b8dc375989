"""Weight-only quantized (WOQ) linear layers: the layout, and its torch reference.

For a layer of N output and K input features, `bits` b in {4, 8} and `group_size` G in
{16, 32, 64, 128} along K (K % G == 0):
- `qweight`: uint8 [N, K * b // 8]; row n is output channel n. b=4: byte j of a row holds
  q[n, 2j] in its low nibble and q[n, 2j + 1] in its high nibble; b=8: byte k holds q[n, k].
  The values are unsigned (0..15 or 0..255).
- `scales`, `mins`: float16 [N, K // G].
- the weight: w[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G], computed in float32
  and then cast to the activation dtype.

Every checkpoint format's repacker produces this layout, and the Triton kernels
(kernels/triton_woq.py) read it as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

WOQ_BITS = (4, 8)
WOQ_GROUP_SIZES = (16, 32, 64, 128)


def check_woq(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, group_size: int
) -> tuple[int, int]:
    """(N, K) of a WOQ layer; ValueError naming the field that breaks the layout."""
    if bits not in WOQ_BITS:
        raise ValueError(f"bits must be one of {WOQ_BITS}, got {bits}")
    if group_size not in WOQ_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {WOQ_GROUP_SIZES}, got {group_size}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(
            f"qweight must be a 2-D uint8 tensor, got {qweight.dtype} {tuple(qweight.shape)}"
        )
    n, k = qweight.shape[0], qweight.shape[1] * 8 // bits
    if k % group_size:
        raise ValueError(f"qweight holds {k} input features, not a multiple of {group_size}")
    for name, t in (("scales", scales), ("mins", mins)):
        if t.dtype != torch.float16 or tuple(t.shape) != (n, k // group_size):
            raise ValueError(
                f"{name} must be float16 of shape {(n, k // group_size)}, "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    return n, k


def woq_pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes [N, K] (0 .. 2**bits - 1) -> the layout's uint8 qweight."""
    if bits not in WOQ_BITS:
        raise ValueError(f"bits must be one of {WOQ_BITS}, got {bits}")
    if q.dim() != 2 or (bits == 4 and q.shape[1] % 2):
        raise ValueError(f"q must be 2-D with an even number of columns, got {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) >= 1 << bits):
        raise ValueError(f"q holds values outside 0..{(1 << bits) - 1}")
    q = q.to(torch.uint8)
    if bits == 8:
        return q.contiguous()
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def woq_unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The layout's qweight -> its integer codes, uint8 [N, K]."""
    if bits == 8:
        return qweight.clone()
    low, high = qweight & 0xF, qweight >> 4
    return torch.stack((low, high), dim=-1).reshape(qweight.shape[0], -1)


def woq_dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """The layer's weight, float32 [N, K]."""
    check_woq(qweight, scales, mins, bits, group_size)
    q = woq_unpack(qweight, bits).float()
    s = scales.float().repeat_interleave(group_size, dim=1)
    m = mins.float().repeat_interleave(group_size, dim=1)
    return q * s + m


def woq_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear with the dequantized weight: the weight is rounded to x's dtype, the
    products are summed in float32 (as the kernels do) and the result has x's dtype."""
    w = woq_dequantize(qweight, scales, mins, bits, group_size).to(x.dtype).float()
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the layer takes {w.shape[1]}")
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def woq_quantize_rtn(
    w: torch.Tensor, bits: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest, asymmetric per group: a float weight [N, K] -> (qweight, scales,
    mins) with mins the group's minimum and scales its range over 2**bits - 1. The codes
    are rounded against the float16 scale and min that are stored."""
    if bits not in WOQ_BITS:
        raise ValueError(f"bits must be one of {WOQ_BITS}, got {bits}")
    if group_size not in WOQ_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {WOQ_GROUP_SIZES}, got {group_size}")
    if w.dim() != 2 or w.shape[1] % group_size:
        raise ValueError(
            f"w must be 2-D with a multiple of {group_size} columns, got {tuple(w.shape)}"
        )
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    maxq = (1 << bits) - 1
    scales = ((hi - lo) / maxq).half()
    # A constant group keeps scale 0 and is its min; the codes are then all 0.
    mins = lo.half()
    s = scales.float().unsqueeze(2)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round((groups - mins.float().unsqueeze(2)) / safe).clamp(0, maxq)
    return woq_pack(q.reshape(n, k).to(torch.uint8), bits), scales, mins
