"""Triton RMSNorm and residual-add + RMSNorm; drop-ins for norm_ref.

One program per row, the whole row in registers: hidden sizes of the models we serve
(<= 16K) fit, and one pass over the row is all the bandwidth these need.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, wait_for_previous_kernel


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The sum is rounded to the activation dtype before the norm, as the reference does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols, (xf * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    rows = t.reshape(-1, hidden)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _launch(x, residual, weight, eps):
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} != ({hidden},)"
    assert weight.is_contiguous(), "weight must be contiguous"
    x2 = _rows(x, hidden)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != {tuple(x.shape)}"
        r2 = _rows(residual, hidden)
        residual_out = torch.empty_like(out)
        ro2 = residual_out.view(-1, hidden)
    else:
        r2, ro2, residual_out = x2, out2, None
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out2,
            ro2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            ro2.stride(0),
            hidden,
            eps,
            BLOCK=block,
            ADD_RESIDUAL=residual is not None,
            **pdl_launch(x),
            num_warps=min(16, max(1, block // 512)),
        )
    return out, residual_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in float32."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual') in fresh tensors."""
    return _launch(x, residual, weight, eps)
