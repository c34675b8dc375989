"""Triton activation quantizers for the W8A8 paths (kernels/fp8_ref.py defines the numerics).

Both take a 16-bit x [M, K] and write e4m3 q [M, K] and float32 scales; they are the only
extra launch of a W8A8 layer, so each reads x once or twice (the second read of a row comes
from cache) and writes q once.

The kernels round to e4m3 themselves (`_round_to_e4m3`) so that the cast to float8 is of a
value it holds exactly: the same result from the GPU's converter and from Triton's
interpreter, whose own float8 rounding drops a carry into the exponent (31.6 -> 16, not
32). That keeps these kernels testable on a CPU. Divisions are IEEE (`tl.div_rn`; Triton's
`/` is approximate on NVIDIA GPUs) so that q and the scales are the reference's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_ref import FP8_DTYPE, FP8_MAX, MIN_SCALE, cdiv
from kernels.pdl import pdl_launch, wait_for_previous_kernel

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)

PER_TOKEN_BLOCK_K = 2048
GROUPS_PER_PROGRAM = 8


@triton.jit
def _round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, as float32.

    e4m3 keeps 3 mantissa bits: values in [2^e, 2^(e+1)) are multiples of 2^(e-3), and
    below 2^-6 (subnormals) of 2^-9. Adding then subtracting 1.5 * 2^23 times that quantum
    makes the float32 adder round |v| to a multiple of it, ties to even; the sign goes back
    on after (so that a small negative v gives -0, as torch's cast does)."""
    bits = v.to(tl.uint32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF).to(tl.int32)
    quantum = ((tl.maximum(exponent, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)
    big = quantum * 12582912.0
    rounded = (tl.abs(v) + big) - big
    return (rounded.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_per_token_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_scale_ptr,
    K,
    stride_x,
    STATIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * K
    wait_for_previous_kernel(USE_PDL)
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_row + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), _FP8_MAX), _MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for k in range(0, K, BLOCK_K):
        ok = k + cols < K
        x = tl.load(x_row + k + cols, mask=ok, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.clamp(tl.div_rn(x, scale), -_FP8_MAX, _FP8_MAX))
        tl.store(q_row + k + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


def quantize_per_token_triton(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (q [M, K] contiguous, scale float32 [M, 1]): each
    row's own scale, or every row the one `static_scale` (a float32 scalar tensor)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    _quantize_per_token_kernel[(m,)](
        x,
        q,
        scale,
        static_scale if static_scale is not None else scale,
        k,
        x.stride(0),
        STATIC=static_scale is not None,
        BLOCK_K=min(PER_TOKEN_BLOCK_K, triton.next_power_of_2(k)),
        **pdl_launch(x),
        num_warps=4,
    )
    return q, scale


# The scales' column stride is M: unspecialized, so that a batch size does not build its
# own variant.
@triton.jit(do_not_specialize=["stride_sg"])
def _quantize_per_token_group_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    num_groups,
    stride_x,
    stride_sm,
    stride_sg,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    GROUPS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    within = tl.arange(0, GROUP_P2)
    cols = groups[:, None] * GROUP + within[None, :]
    ok = (within[None, :] < GROUP) & (cols < K)
    wait_for_previous_kernel(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), _FP8_MAX), _MIN_SCALE)
    q = _round_to_e4m3(tl.clamp(tl.div_rn(x, scale[:, None]), -_FP8_MAX, _FP8_MAX))
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < num_groups)


def quantize_per_token_group_triton(
    x: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (q [M, K], scale float32 [M, ceil(K/group)]). The
    scales are laid out M-fastest (strides (1, M)), as the fp8 GEMM reads a column of them
    per K step."""
    m, k = x.shape
    num_groups = cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_groups, m), dtype=torch.float32, device=x.device).t()
    if m == 0:
        return q, scale
    groups = min(GROUPS_PER_PROGRAM, triton.next_power_of_2(num_groups))
    _quantize_per_token_group_kernel[(m, cdiv(num_groups, groups))](
        x,
        q,
        scale,
        k,
        num_groups,
        x.stride(0),
        scale.stride(0),
        scale.stride(1),
        GROUP=group,
        GROUP_P2=triton.next_power_of_2(group),
        GROUPS=groups,
        **pdl_launch(x),
        num_warps=4,
    )
    return q, scale
