"""Reference AWQ and GPTQ quantizers: a float weight [N, K] -> a checkpoint's tensors in the
format's exact packing (engine/layers/quantization/int4_packing.py describes both), so
tests can write checkpoints. Round-to-nearest per group (no calibration); each returns the
float32 weight that the format's own dequantization gives, `(q - z) * s` with the stored
scale.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from engine.layers.quantization.int4_packing import AWQ_ORDER, pack_int32
from tests.support.bundled_checkpoints import is_quantized_linear


@dataclass
class QuantizedCheckpoint:
    tensors: dict[str, torch.Tensor]
    """The layer's checkpoint tensors by suffix ("qweight", "qzeros", "scales", "g_idx")."""
    dequantized: torch.Tensor
    """float32 [N, K]: the weight the format's own dequantization gives."""
    codes: torch.Tensor
    """int64 [N, K]: the integer codes q."""
    zeros: torch.Tensor
    """int64 [N, K // G]: the zero points z (as the format means them, not as stored)."""


def _rtn_asymmetric(groups: torch.Tensor, bits: int, min_zero: int = 0):
    """groups [..., G] -> (q, z, s16): GPTQ / AWQ style, the range widened to hold 0, the
    zero point an integer in min_zero..maxq; q rounded against the float16 scale."""
    maxq = (1 << bits) - 1
    lo = groups.amin(dim=-1).clamp(max=0)
    hi = groups.amax(dim=-1).clamp(min=0)
    scale = ((hi - lo) / maxq).clamp(min=1e-5).half()
    s = scale.float()
    z = torch.round(-lo / s).clamp(min_zero, maxq)
    q = (torch.round(groups / s.unsqueeze(-1)) + z.unsqueeze(-1)).clamp(0, maxq)
    return q.to(torch.int64), z.to(torch.int64), scale


def _rtn_symmetric(groups: torch.Tensor, bits: int):
    """GPTQ sym=True: the zero point fixed at 2**(bits-1), the scale from the largest |w|."""
    maxq = (1 << bits) - 1
    amax = groups.abs().amax(dim=-1)
    scale = (2 * amax / maxq).clamp(min=1e-5).half()
    s = scale.float()
    z = torch.full_like(amax, 1 << (bits - 1))
    q = (torch.round(groups / s.unsqueeze(-1)) + z.unsqueeze(-1)).clamp(0, maxq)
    return q.to(torch.int64), z.to(torch.int64), scale


def _dequantized(q: torch.Tensor, z: torch.Tensor, s16: torch.Tensor, group_of: torch.Tensor):
    """(q - z) * s in float32 for codes [N, K], z and s [N, K/G], input k in group_of[k]."""
    return (q - z[:, group_of]).float() * s16.float()[:, group_of]


def awq_quantize(w: torch.Tensor, group_size: int) -> QuantizedCheckpoint:
    """4-bit AWQ (GEMM format) tensors of w [N, K]."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    q, z, s16 = _rtn_asymmetric(groups, 4)
    q = q.reshape(n, k)
    order = torch.tensor(AWQ_ORDER)

    def pack_awq(values_kn: torch.Tensor) -> torch.Tensor:
        # field i of each word takes output 8c + AWQ_ORDER[i]
        rows = values_kn.shape[0]
        fields = values_kn.reshape(rows, -1, 8)[:, :, order].reshape(rows, -1)
        return pack_int32(fields, 4, dim=1)

    tensors = {
        "qweight": pack_awq(q.t()),
        "qzeros": pack_awq(z.t()),
        "scales": s16.t().contiguous(),
    }
    group_of = torch.arange(k) // group_size
    return QuantizedCheckpoint(tensors, _dequantized(q, z, s16, group_of), q, z)


def gptq_quantize(
    w: torch.Tensor,
    group_size: int,
    bits: int = 4,
    sym: bool = False,
    act_order: bool = False,
    zeros_stored_minus_one: bool = True,
    seed: int = 0,
) -> QuantizedCheckpoint:
    """GPTQ tensors of w [N, K]. act_order: the inputs are grouped in a random order (as
    activation-order quantization does), so g_idx is a permutation of the groups, not
    k // G. The classic format stores z - 1 and cannot hold a zero point of 0: asymmetric
    zero points are then kept at 1 or more."""
    n, k = w.shape
    if act_order:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    else:
        order = torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    groups = w.float()[:, order].reshape(n, k // group_size, group_size)
    if sym:
        q_ordered, z, s16 = _rtn_symmetric(groups, bits)
    else:
        q_ordered, z, s16 = _rtn_asymmetric(groups, bits, 1 if zeros_stored_minus_one else 0)
    q = torch.empty(n, k, dtype=torch.int64)
    q[:, order] = q_ordered.reshape(n, k)
    stored_z = z - 1 if zeros_stored_minus_one else z
    tensors = {
        "qweight": pack_int32(q.t(), bits, dim=0),
        "qzeros": pack_int32(stored_z.t(), bits, dim=1),
        "scales": s16.t().contiguous(),
        "g_idx": g_idx,
    }
    return QuantizedCheckpoint(tensors, _dequantized(q, z, s16, g_idx.long()), q, z)


# Layers that read the same input share an activation order (as GPTQ's Hessian gives them).
_INPUT_OF = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "o_proj": "o",
    "down_proj": "down",
}


def int4_checkpoint(weights: dict[str, torch.Tensor], config: dict):
    """A whole model's AWQ or GPTQ checkpoint (its quantization_config: `config`) of HF-named
    float weights: (checkpoint tensors, the float weights they dequantize to)."""
    tensors, floats = {}, {}
    for name, w in weights.items():
        if not is_quantized_linear(name):
            tensors[name] = floats[name] = w
            continue
        base = name.removesuffix(".weight")
        if config["quant_method"] == "awq":
            made = awq_quantize(w, config["group_size"])
        else:
            layer, module = base.split(".")[2], base.rsplit(".", 1)[1]
            seed = zlib.crc32(f"{layer}.{_INPUT_OF[module]}".encode())
            made = gptq_quantize(
                w,
                config["group_size"],
                bits=config["bits"],
                sym=config["sym"],
                act_order=config["desc_act"],
                seed=seed,
            )
        tensors |= {f"{base}.{suffix}": t for suffix, t in made.tensors.items()}
        floats[name] = made.dequantized
    return tensors, floats
