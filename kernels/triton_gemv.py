"""Triton matrix-vector product for one-token steps: y = x @ W.T (+ b), x [1, K], W [N, K].

At batch 1 every linear layer is a pass over its weight. cuBLAS reaches ~89 % of copy
bandwidth on the MLP's wide matrices but 67-77 % on qkv_proj and o_proj (bench/RESULTS.md);
this kernel streams rows of W in tiles of BLOCK_N x BLOCK_K, keeps an fp32 partial sum per
element of the tile and reduces it once at the end. The tile shape is timed per (N, K) on
the first call on a GPU, which the engine makes before it captures CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_N, BLOCK_K, num_warps); the first is the untuned default.
_CONFIGS = [
    (8, 512, 4),
    (4, 512, 4),
    (8, 256, 4),
    (8, 512, 8),
    (16, 256, 4),
    (16, 256, 8),
    (16, 512, 8),
    (32, 128, 4),
    (32, 256, 8),
]
_tuned: dict[tuple, tuple[int, int, int]] = {}


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
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
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


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear for a single row: x [1, K] (or [K]) and weight [N, K] -> [1, N] (or [N])."""
    n, k = weight.shape
    if x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"gemv takes one row of {k} features, got x of shape {tuple(x.shape)}")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    x_flat = x.reshape(k)
    if x_flat.stride(0) != 1:
        x_flat = x_flat.contiguous()
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    b = bias if bias is not None else weight

    def launch(config):
        block_n, block_k, warps = config
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x_flat,
            weight,
            b,
            y,
            n,
            k,
            weight.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=warps,
        )

    launch(_config_for(n, k, weight.dtype, x.device, launch))
    return y


def _config_for(n: int, k: int, dtype: torch.dtype, device: torch.device, launch):
    """The fastest tile for this shape on a GPU, timed once (never inside a graph capture)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return _tuned.get((n, k, dtype), _CONFIGS[0])
    key = (n, k, dtype)
    if key not in _tuned:
        times = [triton.testing.do_bench(lambda c=c: launch(c), warmup=5, rep=20) for c in _CONFIGS]
        _tuned[key] = _CONFIGS[times.index(min(times))]
    return _tuned[key]
