"""AWQ and GPTQ checkpoint tensors -> the WOQ layout of kernels/woq_ref.py.

Both formats pack 32 // bits codes in an int32, field i in bits [bits*i, bits*(i+1)):

AWQ (GEMM kernels' format, 4 bits), for a layer of K inputs, N outputs, group size G:
    qweight int32 [K, N/8]    packed along N; field i of word c is output 8c + AWQ_ORDER[i]
    qzeros  int32 [K/G, N/8]  the same packing
    scales  [K/G, N]          w = (q - z) * s

GPTQ (bits 4 or 8, p = 32 // bits codes a word):
    qweight int32 [K/p, N]    packed along K; field i of word r is input p*r + i
    qzeros  int32 [K/G, N/p]  packed along N in plain order; the classic format stores z - 1
    scales  [K/G, N]          w = (q - z) * s
    g_idx   int32 [K]         the group of each input; k // G unless quantized in
                              activation order ("act-order", desc_act)

The zero point becomes `mins = -z * s`, rounded to the layout's float16 (that rounding, at
most 2**-11 of z * s, is the only change a repack makes to the weight).
"""

from __future__ import annotations

import torch

from kernels.woq_ref import WOQ_GROUP_SIZES, woq_pack

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Field i of an AWQ word holds output 8c + AWQ_ORDER[i] of its block of eight."""
_AWQ_FIELD_OF = tuple(AWQ_ORDER.index(j) for j in range(8))  # output j -> its field


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> int64 codes, field i of word j at index (32 // bits) * j + i along
    `dim` (plain order)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device)
    moved = packed.movedim(dim, -1).to(torch.int64)
    codes = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(*moved.shape[:-1], moved.shape[-1] * per_word)
    return codes.movedim(-1, dim)


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The reverse of `unpack_int32`: codes (0 .. 2**bits - 1) -> int32 words along `dim`."""
    per_word = 32 // bits
    moved = codes.movedim(dim, -1).to(torch.int64)
    if moved.shape[-1] % per_word:
        raise ValueError(f"codes: {moved.shape[-1]} values along dim {dim} fill no whole words")
    if moved.numel() and (int(moved.min()) < 0 or int(moved.max()) >= 1 << bits):
        raise ValueError(f"codes hold values outside 0..{(1 << bits) - 1}")
    fields = moved.reshape(*moved.shape[:-1], -1, per_word)
    shifts = torch.arange(0, 32, bits, device=codes.device)
    words = (fields << shifts).sum(dim=-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # two's complement
    return words.to(torch.int32).movedim(-1, dim)


def _check_int32(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.int32 or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be int32 of shape {shape}, got {t.dtype} {tuple(t.shape)}")


def _check_scales(scales: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not scales.is_floating_point() or tuple(scales.shape) != shape:
        raise ValueError(
            f"scales must be floating point of shape {shape}, got {scales.dtype} "
            f"{tuple(scales.shape)}"
        )


def _check_group(group_size: int, k: int) -> None:
    if group_size not in WOQ_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {WOQ_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide the {k} input features")


def _to_woq(q_kn: torch.Tensor, z: torch.Tensor, s: torch.Tensor, bits: int):
    """Codes [K, N], zero points and scales [K/G, N] -> (qweight, scales, mins)."""
    s = s.float()
    mins = (-(z.float() * s)).t().contiguous().half()
    return woq_pack(q_kn.t(), bits), s.t().contiguous().half(), mins


def awq_to_woq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An AWQ layer's tensors -> the WOQ (qweight, scales, mins), 4 bits."""
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [K, N/8], got shape {tuple(qweight.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _check_group(group_size, k)
    _check_int32("qweight", qweight, (k, n // 8))
    _check_int32("qzeros", qzeros, (k // group_size, n // 8))
    _check_scales(scales, (k // group_size, n))
    field_of = torch.tensor(_AWQ_FIELD_OF, device=qweight.device)

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        fields = unpack_int32(packed, 4, dim=1)  # plain field order within each word
        rows = fields.shape[0]
        return fields.reshape(rows, -1, 8)[:, :, field_of].reshape(rows, -1)

    return _to_woq(unpack(qweight), unpack(qzeros), scales, 4)


def gptq_to_woq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    bits: int = 4,
    zeros_stored_minus_one: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A GPTQ layer's tensors -> the WOQ (qweight, scales, mins, perm).

    perm is None when g_idx is absent or k // G. Otherwise (act-order) the inputs are
    sorted by group: input j of the returned weight is the checkpoint's input perm[j], so
    the layer computes `woq_linear(x[:, perm], ...)`, the same product as the checkpoint's.
    Each group must hold exactly G inputs. zeros_stored_minus_one: the classic format (z
    stored as z - 1, read back as stored + 1, as GPTQ kernels do); False for gptq_v2
    checkpoints, which store z.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [K*bits/32, N], got shape {tuple(qweight.shape)}")
    per_word = 32 // bits
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    _check_group(group_size, k)
    if n % per_word:
        raise ValueError(f"qweight: {n} outputs do not fill whole words of qzeros")
    _check_int32("qweight", qweight, (k // per_word, n))
    _check_int32("qzeros", qzeros, (k // group_size, n // per_word))
    _check_scales(scales, (k // group_size, n))
    q = unpack_int32(qweight, bits, dim=0)  # [K, N]
    z = unpack_int32(qzeros, bits, dim=1) + (1 if zeros_stored_minus_one else 0)
    perm = _act_order_perm(g_idx, k, group_size)
    if perm is not None:
        q = q[perm]
    return (*_to_woq(q, z, scales, bits), perm)


def _act_order_perm(g_idx: torch.Tensor | None, k: int, group_size: int) -> torch.Tensor | None:
    """None for the plain k // G grouping; else the inputs sorted by group (stable)."""
    if g_idx is None:
        return None
    if g_idx.dim() != 1 or g_idx.shape[0] != k or g_idx.is_floating_point():
        raise ValueError(
            f"g_idx must be an integer tensor of shape ({k},), got {tuple(g_idx.shape)}"
        )
    g_idx = g_idx.to(torch.int64)
    plain = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx, plain):
        return None
    num_groups = k // group_size
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups:
        raise ValueError(f"g_idx holds groups outside 0..{num_groups - 1}")
    counts = torch.bincount(g_idx, minlength=num_groups)
    if not bool((counts == group_size).all()):
        raise ValueError(f"g_idx must give every group exactly {group_size} inputs")
    return torch.argsort(g_idx, stable=True)
