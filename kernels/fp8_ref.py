"""Torch references for FP8 (float8_e4m3fn) weights: quantizers and the two linear layers.

A weight w [N, K] is stored as q (float8_e4m3fn) with float32 scales, w = q * scale:
per output channel (`weight_scale` [N], or [1] for one scale per tensor), or per 128 x 128
block (`weight_scale_inv` [ceil(N/128), ceil(K/128)], the block-wise checkpoints' name).
A scale is amax / 448 (448: e4m3's largest finite value).

Which activations are quantized (the same rule on every device; the GPU kernels follow it):
- Decode-sized batches (at most `W8A16_MAX_TOKENS` rows) keep their 16-bit activations: the
  GPU multiplies them by the weight dequantized in registers (W8A16). A one-token step reads
  each weight once either way, and this saves a quantization launch per layer; a static
  `input_scale` is not used there.
- Larger batches quantize their activations to e4m3 and multiply on fp8 tensor cores (W8A8):
  per token with its own scale (amax / 448 of the row), or with the checkpoint's static
  scalar `input_scale`. Block-wise weights take one activation scale per token and
  128-column group (the block's width), the scheme their checkpoints were made for; the
  block scales then apply per (group, block) product. Blocks too narrow for an fp8 dot's
  K step (32) keep W8A16.
- `fp8_linear` keeps W8A16 at any batch where N or K is not a multiple of 16: fp8 GEMMs
  (torch._scaled_mm) need both.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
# The smallest scale: an all-zero row (amax 0) gets this instead of 0, so x / scale stays
# finite (and zero) rather than NaN.
MIN_SCALE = float(torch.finfo(torch.float32).tiny)
W8A16_MAX_TOKENS = 16
DEFAULT_BLOCK = (128, 128)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


FP8_DOT_MIN_K = 32
"""The least K step of a tensor-core dot of two fp8 operands (16-bit ones take 16)."""


def block_k_step(columns: int, least: int) -> int | None:
    """The largest power of two up to 128 that divides a block's `columns`, if at least
    `least` (a K step that keeps each step inside one block of scales); else None."""
    step = 128
    while columns % step:
        step //= 2
    return step if step >= least else None


def quantizes_activations(num_tokens: int, n: int, k: int, block: tuple[int, int] | None) -> bool:
    """Whether a batch of `num_tokens` rows through an [n, k] fp8 layer quantizes its
    activations (W8A8) or keeps them 16-bit (W8A16); see the module docstring. block: the
    weight's block scales (None: per-channel); blocks too narrow for an fp8 dot's K step
    keep W8A16."""
    if num_tokens <= W8A16_MAX_TOKENS:
        return False
    if block is not None:
        return block_k_step(block[1], FP8_DOT_MIN_K) is not None
    return n % 16 == 0 and k % 16 == 0


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """float32 scale amax / 448, at least MIN_SCALE. Divided by a tensor of 448s: CUDA
    divides by a scalar as a multiplication by its reciprocal, a bit off true division
    (which the Triton quantizers do)."""
    amax = amax.float()
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3, saturated at +-448 (a cast alone would give NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q float8_e4m3fn [N, K], scale float32 [N] per channel or [1])."""
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    scale = scale_of(amax)
    return to_fp8(w, scale[:, None]), scale


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)]): one scale per
    block, partial blocks at the edges included."""
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    bn, bk = _check_block(block)
    padded = w.new_zeros(cdiv(n, bn) * bn, cdiv(k, bk) * bk)
    padded[:n, :k] = w
    tiles = padded.reshape(cdiv(n, bn), bn, cdiv(k, bk), bk)
    scale = scale_of(tiles.abs().amax(dim=(1, 3)))
    return to_fp8(w, _expand_block_scale(scale, n, k, block)), scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K], scale float32 [M, 1]), one scale per row."""
    scale = scale_of(x.abs().amax(dim=-1, keepdim=True))
    return to_fp8(x, scale), scale


def quantize_fp8_per_token_group(
    x: torch.Tensor, group: int = DEFAULT_BLOCK[1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K], scale float32 [M, ceil(K/group)]), one scale per row and
    group of `group` columns (the last group may be partial)."""
    m, k = x.shape
    padded = x.new_zeros(m, cdiv(k, group) * group)
    padded[:, :k] = x
    scale = scale_of(padded.reshape(m, -1, group).abs().amax(dim=2))
    return to_fp8(x, scale.repeat_interleave(group, dim=1)[:, :k]), scale


def dequantize_fp8_block(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> torch.Tensor:
    """float32 q * scale_inv of its block."""
    n, k = q.shape
    return q.float() * _expand_block_scale(scale_inv.float(), n, k, block)


def _expand_block_scale(
    scale: torch.Tensor, n: int, k: int, block: tuple[int, int]
) -> torch.Tensor:
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:n, :k]


def _check_block(block) -> tuple[int, int]:
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"block must be two positive ints (rows, columns), got {block}")
    return block[0], block[1]


def check_fp8_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None = None,
) -> None:
    """The checks both linear layers share; ValueError naming the bad argument."""
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE:
        raise ValueError(
            f"weight must be a 2-D {FP8_DTYPE} tensor, got {weight.dtype} "
            f"of shape {tuple(weight.shape)}"
        )
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must end in {weight.shape[1]} features, got shape {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"input_scale must be one scalar, got shape {tuple(input_scale.shape)}")


def check_channel_scale(weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    if weight_scale.dim() > 1 or weight_scale.numel() not in (1, weight.shape[0]):
        raise ValueError(
            f"weight_scale must have shape ({weight.shape[0]},) or (1,), "
            f"got {tuple(weight_scale.shape)}"
        )


def check_block_scale(
    weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int]
) -> tuple[int, int]:
    bn, bk = _check_block(block)
    expected = (cdiv(weight.shape[0], bn), cdiv(weight.shape[1], bk))
    if tuple(weight_scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv must have shape {expected} for block {block}, "
            f"got {tuple(weight_scale_inv.shape)}"
        )
    return bn, bk


def _finish(
    x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """a [M, K] @ w [N, K].T + bias in float32, shaped like x with N features, x's dtype."""
    y = a @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ (weight * weight_scale[:, None]).T + bias, weight [N, K] fp8,
    weight_scale [N] or [1]; activations per the module docstring."""
    check_fp8_args(x, weight, bias, input_scale)
    check_channel_scale(weight, weight_scale)
    n, k = weight.shape
    a = x.reshape(-1, k).float()
    if quantizes_activations(a.shape[0], n, k, None):
        if input_scale is None:
            q, a_scale = quantize_fp8_per_token(a)
        else:
            a_scale = input_scale.float().reshape(1, 1)
            q = to_fp8(a, a_scale)
        a = q.float() * a_scale
    w = weight.float() * weight_scale.float().reshape(-1, 1)
    return _finish(x, a, w, bias)


def fp8_block_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> torch.Tensor:
    """x [..., K] @ dequantize_fp8_block(weight, weight_scale_inv).T + bias; activations per
    the module docstring (groups of block[1] columns)."""
    check_fp8_args(x, weight, bias)
    check_block_scale(weight, weight_scale_inv, block)
    n, k = weight.shape
    a = x.reshape(-1, k).float()
    if quantizes_activations(a.shape[0], n, k, block):
        q, a_scale = quantize_fp8_per_token_group(a, block[1])
        a = q.float() * a_scale.repeat_interleave(block[1], dim=1)[:, :k]
    return _finish(x, a, dequantize_fp8_block(weight, weight_scale_inv, block), bias)
