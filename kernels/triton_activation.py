"""Triton SiLU-and-multiply; drop-in for activation_ref."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, wait_for_previous_kernel


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up, [..., I]."""
    assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} must be even (gate | up)"
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * inter)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, inter)
    block = min(1024, triton.next_power_of_2(max(inter, 1)))
    if rows.shape[0] > 0 and inter > 0:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows,
            out_rows,
            rows.stride(0),
            out_rows.stride(0),
            inter,
            BLOCK=block,
            **pdl_launch(x),
        )
    return out
