"""FP8 linear layers on the GPU; kernels/fp8_ref.py defines what each computes.

`fp8_linear_triton` (per-channel or per-tensor weight scales):
- one token: the fp8 GEMV (kernels/triton_fp8_matmul.py);
- up to W8A16_MAX_TOKENS tokens, or a weight whose N or K is not a multiple of 16: the
  W8A16 tensor-core GEMM, weight widened in registers;
- more tokens: activations quantized per token (or by the static input_scale) in one small
  kernel, then torch._scaled_mm with row-wise scales (scale_a [M, 1], scale_b [1, N]):
  cuBLAS / CUTLASS fp8 tensor cores, bias and output dtype in its epilogue. Fast
  accumulation as fp8 GEMMs for inference commonly use it; the error it adds is far
  below the activations' own rounding to e4m3.
`fp8_block_linear_triton` (128 x 128 block scales): the GEMV for one token, the W8A16 GEMM
up to W8A16_MAX_TOKENS, then activations quantized per token and 128-column group and the
block-scaled fp8 GEMM.

No path syncs with the host or reads a tensor's value on it, so every one captures into a
CUDA graph.
"""

from __future__ import annotations

import torch

from kernels.fp8_ref import (
    DEFAULT_BLOCK,
    check_block_scale,
    check_channel_scale,
    check_fp8_args,
    fp8_block_linear_ref,
    quantizes_activations,
)
from kernels.triton_fp8_matmul import fp8_gemm, fp8_gemv, gemm_block_k, gemv_fits
from kernels.triton_fp8_quant import quantize_per_token_group_triton, quantize_per_token_triton

# Fast accumulation: see the module docstring.
SCALED_MM_FAST_ACCUM = True


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as [M, K] with unit column stride (a view where it already is one)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bfloat16 or float16 for the fp8 kernels, got {x.dtype}")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _row_major(weight: torch.Tensor) -> torch.Tensor:
    return weight if weight.stride(1) == 1 else weight.contiguous()


def _scaled_mm(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """q [M, K] fp8 @ weight [N, K].T with row-wise scales; weight.t() is the column-major
    operand cuBLAS wants, without a copy."""
    n = weight.shape[0]
    scale_b = weight_scale.float().expand(n).contiguous().view(1, n)
    return torch._scaled_mm(
        q,
        weight.t(),
        scale_a=q_scale,
        scale_b=scale_b,
        bias=None if bias is None else bias.to(out_dtype),
        out_dtype=out_dtype,
        use_fast_accum=SCALED_MM_FAST_ACCUM,
    )


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp8_linear_ref on CUDA tensors: x [..., K] 16-bit, weight [N, K] fp8, weight_scale
    [N] or [1] float32, input_scale a float32 scalar or None."""
    check_fp8_args(x, weight, bias, input_scale)
    check_channel_scale(weight, weight_scale)
    n, k = weight.shape
    a = _rows(x, k)
    weight = _row_major(weight)
    m = a.shape[0]
    if quantizes_activations(m, n, k, None):
        static = None if input_scale is None else input_scale.float().reshape(())
        q, q_scale = quantize_per_token_triton(a, static)
        y = _scaled_mm(q, q_scale, weight, weight_scale, bias, x.dtype)
    elif m == 1:
        y = fp8_gemv(a, weight, weight_scale, bias)
    else:
        y = fp8_gemm(a, None, weight, weight_scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], n)


def fp8_block_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> torch.Tensor:
    """fp8_block_linear_ref on CUDA tensors. A block whose column count has no power-of-two
    divisor of 16 or more fits no tensor-core K step: such a weight takes the reference."""
    check_fp8_args(x, weight, bias)
    block = check_block_scale(weight, weight_scale_inv, block)
    if gemm_block_k(block) is None:
        return fp8_block_linear_ref(x, weight, weight_scale_inv, bias, block)
    n, k = weight.shape
    a = _rows(x, k)
    weight = _row_major(weight)
    scale = weight_scale_inv.float()
    m = a.shape[0]
    if quantizes_activations(m, n, k, block):
        q, q_scale = quantize_per_token_group_triton(a, block[1])
        y = fp8_gemm(q, q_scale, weight, scale, bias, x.dtype, block)
    elif m == 1 and gemv_fits(block):
        y = fp8_gemv(a, weight, scale, bias, block)
    else:
        y = fp8_gemm(a, None, weight, scale, bias, x.dtype, block)
    return y.reshape(*x.shape[:-1], n)
