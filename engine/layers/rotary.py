"""Rotary position embedding: one cos/sin table per model, applied by kernels.apply_rotary."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import kernels

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_config(config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict with "rope_type") from a HF config of either generation.

    transformers 5 keeps both under `rope_parameters`; older configs use `rope_theta` and
    `rope_scaling` (whose type key may be "type").
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or params)
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    scaling["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
    scaling.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return float(theta), scaling


def compute_inv_freq(head_dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, as transformers computes them (on CPU)."""
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={scaling['partial_rotary_factor']} is not supported; only 1.0"
        )
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponent)
    if rope_type == "default":
        return inv_freq

    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any]):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, base, scaling)
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        # float32 whatever the model dtype: rounding cos/sin to bf16 shifts far positions.
        self.register_buffer(
            "cos_sin_cache", cache.to(torch.get_default_device()), persistent=False
        )

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, Hq, D] and key [T, Hkv, D] in place; returns them."""
        kernels.apply_rotary(positions, query, key, self.cos_sin_cache)
        return query, key


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    theta, scaling = rope_config(config)
    return RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)
