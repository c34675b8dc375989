"""Triton matrix-vector products for one-token steps: y = x @ W.T (+ b), x [1, K], W [N, K].

At batch 1 every linear layer is one pass over its weight. Each program streams BLOCK_N
rows of W in BLOCK_K-wide tiles, keeps a float32 partial sum per tile element and reduces
once at the end. Timed as the model runs them (a CUDA graph over 32 layers' distinct
weights, H200, bench/NOTES-kernels.md), two rows by 1024 columns is the fastest tile or
within 3 % of it for every llama3-8b layer, whole and halved for two GPUs (TP=2 qkv_proj:
7 %), and beats cuBLAS by 4-19 % on qkv_proj, o_proj and down_proj (level on gate_up).

Every program reads all of x (from L2) beside its own rows of W. Folding the RMSNorm and
residual add into this prologue (x, residual and norm weight per program) made the model
slower, not faster: 3 vectors of L2 reads per 2 rows of weight (bench/NOTES-kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, wait_for_previous_kernel

BLOCK_N = 2
BLOCK_K = 1024
NUM_WARPS = 4


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_w,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :]
    # The first weight tile is read while the kernel before may still run (kernels.pdl);
    # x is that kernel's output, so it waits.
    col_ok = cols < K
    w = tl.load(
        w_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0, eviction_policy="evict_first"
    )
    wait_for_previous_kernel(USE_PDL)
    x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc = w.to(tl.float32) * x[None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        col_ok = k + cols < K
        x = tl.load(x_ptr + k + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptrs + k,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear for one row: x [1, K], weight [N, K] -> [1, N]."""
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"gemv takes one row of {weight.shape[1]} features, got x of shape {tuple(x.shape)}"
        )
    n, k = weight.shape
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        x.contiguous(),
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        **pdl_launch(x),
        num_warps=NUM_WARPS,
    )
    return y
