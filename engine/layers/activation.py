"""Gated-MLP activation."""

from __future__ import annotations

import torch
from torch import nn

import kernels


class SiluAndMul(nn.Module):
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x)
