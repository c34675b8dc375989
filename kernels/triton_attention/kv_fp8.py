"""The fp8 KV cache in the Triton kernels: what the store and attention kernels share.

An fp8 cache (float8_e4m3fn) holds key / k_scale and value / v_scale, saturated to +-448;
attention reads stored * scale. The scales are float32 one-element tensors (one pair per
layer), passed by pointer so that a CUDA graph reads the values at replay. Every kernel
takes the fp8 handling as a constexpr: a 16-bit cache's kernels are the ones they were,
with unused scale pointers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_ref import FP8_KV_DTYPE
from kernels.attention_ref import FP8_MAX as _FP8_MAX

FP8_MAX = tl.constexpr(_FP8_MAX)

_unit_scales: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on `device`, kept: the scale of a call that gives none."""
    one = _unit_scales.get(device)
    if one is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("pass k_scale and v_scale to a kernel captured in a CUDA graph")
        one = _unit_scales[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def kv_scale_args(
    kv_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k scale, v scale, whether the cache is fp8) as the kernels take them. A 16-bit
    cache ignores the scales: the cache itself stands in for the unused pointers."""
    if kv_cache.dtype != FP8_KV_DTYPE:
        return kv_cache, kv_cache, False
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            scale = _unit_scale(kv_cache.device)
        assert scale.numel() == 1 and scale.dtype == torch.float32, f"{name}: one float32"
        assert scale.device == kv_cache.device, f"{name} must be on the cache's device"
        scales.append(scale)
    return scales[0], scales[1], True


@triton.jit
def load_inverse_scale(scale_ptr, KV_FP8: tl.constexpr):
    """1 / scale for the store (one correctly rounded division per program), 1.0 unused."""
    if KV_FP8:
        inverse = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.load(scale_ptr))
    else:
        inverse = 1.0
    return inverse


@triton.jit
def to_cache(x, inverse_scale, cache_ty, KV_FP8: tl.constexpr):
    """x as the cache stores it: fp8 x * inverse_scale saturated to +-448, else x cast."""
    if KV_FP8:
        x = tl.clamp(x.to(tl.float32) * inverse_scale, -FP8_MAX, FP8_MAX)
    return x.to(cache_ty)
