"""The FP8 Triton paths (kernels/triton_fp8*.py) against the torch references.

On CPU the kernels run in Triton's interpreter (float16 only: it computes bfloat16 dots
wrongly) and torch._scaled_mm runs on CPU; on a GPU (`-m gpu`) the same tests run for real
with bfloat16 too, beside the GPU-only ones (model shapes, CUDA graphs, dispatch).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import kernels
from kernels.fp8_ref import (
    FP8_DTYPE,
    W8A16_MAX_TOKENS,
    fp8_block_linear_ref,
    fp8_linear_ref,
    quantize_fp8,
    quantize_fp8_block,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group,
    to_fp8,
)

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
# Token counts: one (GEMV), a decode batch (W8A16 GEMM), larger (W8A8).
NUM_TOKENS = [1, 7, 64, 300] if HAS_CUDA else [1, 7, 40]
TOLERANCES = {
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def triton_test(fn):
    """Marked `gpu` on a GPU machine; interpreted on CPU otherwise."""
    return pytest.mark.gpu(fn) if HAS_CUDA else fn


def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(fn))


def dtype_id(value) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# fp8 x fp8 products on tensor cores (torch._scaled_mm with fast accumulation, as vLLM's
# fp8 GEMMs run, and Triton's fp8 dots) carry partial sums with fewer bits than float32
# for a few K steps at a time: results of order 1 differ from the float32 reference by a
# few hundredths at K in the thousands.
W8A8_TOLERANCE = dict(atol=6e-2, rtol=3e-2)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "NaN in kernel output"
    m, n = out.reshape(-1, out.shape[-1]).shape
    w8a8 = out.is_cuda and m > W8A16_MAX_TOKENS
    tolerance = W8A8_TOLERANCE if w8a8 else TOLERANCES[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), **tolerance)


def make_inputs(m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool):
    """x [m, k] and a bias; outputs come out of order 1 with a weight of scale k^-0.5."""
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    return x, bias


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("static", [False, True])
@triton_test
def test_per_token_quantization_kernel_is_the_reference_bit_for_bit(dtype, static):
    from kernels.triton_fp8_quant import quantize_per_token_triton

    x = torch.randn(5, 2500, device=DEVICE) * torch.logspace(-3, 3, 5, device=DEVICE)[:, None]
    x[2] = 0
    x = x.to(dtype)
    if static:
        scale = torch.tensor(0.05, device=DEVICE)  # rows 3 and 4 saturate
        q, q_scale = quantize_per_token_triton(x, scale)
        ref_q, ref_scale = to_fp8(x, scale), scale.expand(5, 1)
    else:
        q, q_scale = quantize_per_token_triton(x)
        ref_q, ref_scale = quantize_fp8_per_token(x)
    assert q.dtype == FP8_DTYPE and q_scale.shape == (5, 1) and q_scale.is_contiguous()
    assert torch.equal(q_scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@triton_test
def test_quantization_rounds_every_e4m3_value_and_midpoint_like_torch():
    """Ties to even and carries into the exponent (31.6 -> 32) included."""
    from kernels.triton_fp8_quant import quantize_per_token_triton

    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite()].unique()
    midpoints = (grid[1:] + grid[:-1]) / 2
    row = torch.cat([grid, midpoints, midpoints + 1e-4, midpoints - 1e-4]).to(DEVICE)
    q, scale = quantize_per_token_triton(row[None, :], torch.tensor(1.0, device=DEVICE))
    assert torch.equal(q.float()[0], row.to(FP8_DTYPE).float())


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("group", [128, 48])
@triton_test
def test_per_token_group_quantization_kernel_is_the_reference_bit_for_bit(dtype, group):
    from kernels.triton_fp8_quant import quantize_per_token_group_triton

    x = (torch.randn(3, 1100, device=DEVICE) * 4).to(dtype)  # a partial last group
    x[1, :group] = 0
    q, scale = quantize_per_token_group_triton(x, group)
    ref_q, ref_scale = quantize_fp8_per_token_group(x, group)
    assert scale.stride(0) == 1  # the GEMM reads a column of scales per K step
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


# (n, k): aligned for torch._scaled_mm, and unaligned (W8A16 at every batch).
LINEAR_SHAPES = [(96, 320), (50, 200)]
# (m, n, k, per_channel, with_bias): every combination on a GPU; in the interpreter each
# token count with three that between them take every shape, scale kind and bias case.
LINEAR_CASES = (
    [
        (m, n, k, per_channel, with_bias)
        for m, (n, k), per_channel, with_bias in itertools.product(
            NUM_TOKENS, LINEAR_SHAPES, [True, False], [False, True]
        )
    ]
    if HAS_CUDA
    else [
        case
        for m in NUM_TOKENS
        for case in [(m, 96, 320, True, False), (m, 96, 320, False, True), (m, 50, 200, True, True)]
    ]
)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m,n,k,per_channel,with_bias", LINEAR_CASES)
@triton_test
def test_fp8_linear_matches_reference(dtype, m, n, k, per_channel, with_bias):
    from kernels.triton_fp8 import fp8_linear_triton

    q, scale = quantize_fp8(torch.randn(n, k, device=DEVICE) / k**0.5, per_channel)
    x, bias = make_inputs(m, n, k, dtype, with_bias)
    out = fp8_linear_triton(x, q, scale, bias=bias)
    assert_matches(out, fp8_linear_ref(x, q, scale, bias=bias))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m", NUM_TOKENS)
@triton_test
def test_fp8_linear_with_a_static_input_scale_matches_reference(dtype, m):
    from kernels.triton_fp8 import fp8_linear_triton

    n, k = LINEAR_SHAPES[0]
    q, scale = quantize_fp8(torch.randn(n, k, device=DEVICE) / k**0.5, per_channel=True)
    x, bias = make_inputs(m, n, k, dtype, with_bias=True)
    input_scale = torch.tensor([2.5 / 448], device=DEVICE)  # values past 2.5 saturate
    out = fp8_linear_triton(x, q, scale, input_scale, bias)
    assert_matches(out, fp8_linear_ref(x, q, scale, input_scale, bias))


@triton_test
def test_fp8_linear_takes_strided_and_batched_inputs():
    from kernels.triton_fp8 import fp8_linear_triton

    n, k = LINEAR_SHAPES[0]
    q, scale = quantize_fp8(torch.randn(n, k, device=DEVICE) / k**0.5, per_channel=True)
    wide = torch.randn(24, 2 * k, device=DEVICE).half()
    for x in (wide[:, :k], wide[:1, k:], wide.reshape(2, 12, 2 * k)[..., :k]):
        assert_matches(fp8_linear_triton(x, q, scale), fp8_linear_ref(x, q, scale))


# (n, k, block): the checkpoints' 128 x 128 with partial edge blocks, a narrower block
# (a K step of 32), and a block whose 80 columns take a K step of 16.
BLOCK_SHAPES = [(200, 320, (128, 128)), (96, 256, (64, 32)), (64, 240, (32, 80))]
# (m, n, k, block, with_bias): every combination on a GPU; in the interpreter each shape
# once per token count, the narrower blocks with a bias.
BLOCK_CASES = (
    [
        (m, *shape, with_bias)
        for m, shape, with_bias in itertools.product(NUM_TOKENS, BLOCK_SHAPES, [False, True])
    ]
    if HAS_CUDA
    else [(m, *shape, shape[2] != (128, 128)) for m in NUM_TOKENS for shape in BLOCK_SHAPES]
)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m,n,k,block,with_bias", BLOCK_CASES)
@triton_test
def test_fp8_block_linear_matches_reference(dtype, m, n, k, block, with_bias):
    from kernels.triton_fp8 import fp8_block_linear_triton

    q, scale_inv = quantize_fp8_block(torch.randn(n, k, device=DEVICE) / k**0.5, block)
    x, bias = make_inputs(m, n, k, dtype, with_bias)
    out = fp8_block_linear_triton(x, q, scale_inv, bias, block)
    assert_matches(out, fp8_block_linear_ref(x, q, scale_inv, bias, block))


@triton_test
def test_fp8_block_linear_without_a_tensor_core_k_step_takes_the_reference():
    from kernels.triton_fp8 import fp8_block_linear_triton
    from kernels.triton_fp8_matmul import gemm_block_k

    block = (16, 40)  # 40 = 8 * 5: no power-of-two divisor of 16
    assert gemm_block_k(block) is None
    q, scale_inv = quantize_fp8_block(torch.randn(32, 80, device=DEVICE), block)
    x = torch.randn(W8A16_MAX_TOKENS + 1, 80, device=DEVICE).half()
    out = fp8_block_linear_triton(x, q, scale_inv, None, block)
    assert torch.equal(out, fp8_block_linear_ref(x, q, scale_inv, None, block))


@triton_test
def test_fp8_triton_paths_reject_32_bit_activations():
    from kernels.triton_fp8 import fp8_linear_triton

    q, scale = quantize_fp8(torch.randn(32, 64, device=DEVICE), per_channel=True)
    with pytest.raises(ValueError, match="^x "):
        fp8_linear_triton(torch.randn(2, 64, device=DEVICE), q, scale)


# --- GPU only ---------------------------------------------------------------------------

# llama3-8b's layers: qkv_proj, o_proj, gate_up_proj, down_proj.
LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.parametrize("m", [1, 7, 300])
@pytest.mark.parametrize("n,k", LLAMA_SHAPES)
@gpu_test
def test_fp8_linear_on_model_shapes(m, n, k):
    from kernels.triton_fp8 import fp8_block_linear_triton, fp8_linear_triton

    q, scale = quantize_fp8(torch.randn(n, k, device="cuda") / k**0.5, per_channel=True)
    x, _ = make_inputs(m, n, k, torch.bfloat16, with_bias=False)
    assert_matches(fp8_linear_triton(x, q, scale), fp8_linear_ref(x, q, scale))
    q, scale_inv = quantize_fp8_block(torch.randn(n, k, device="cuda") / k**0.5)
    out = fp8_block_linear_triton(x, q, scale_inv)
    assert_matches(out, fp8_block_linear_ref(x, q, scale_inv))


@pytest.mark.parametrize("m", [1, 7, 64])
@gpu_test
def test_fp8_paths_replay_in_a_cuda_graph(m):
    from kernels.triton_fp8 import fp8_block_linear_triton, fp8_linear_triton

    n, k = 1024, 2048
    q, scale = quantize_fp8(torch.randn(n, k, device="cuda") / k**0.5, per_channel=True)
    qb, scale_inv = quantize_fp8_block(torch.randn(n, k, device="cuda") / k**0.5)
    input_scale = torch.tensor(4.0 / 448, device="cuda")
    x = torch.randn(m, k, device="cuda").bfloat16()
    calls = [
        lambda: fp8_linear_triton(x, q, scale),
        lambda: fp8_linear_triton(x, q, scale, input_scale),
        lambda: fp8_block_linear_triton(x, qb, scale_inv),
    ]
    for call in calls:
        call()  # builds the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call() for call in calls]
    x.copy_(torch.randn(m, k, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    for out, call in zip(outs, calls, strict=True):
        # close, not equal: cuBLAS may pick another algorithm for a capture
        assert_matches(out, call())


@gpu_test
def test_cuda_16_bit_inputs_dispatch_to_triton_unless_forced_to_references(monkeypatch):
    from kernels.triton_fp8 import fp8_block_linear_triton, fp8_linear_triton

    q, scale = quantize_fp8(torch.randn(256, 512, device="cuda"), per_channel=True)
    qb, scale_inv = quantize_fp8_block(torch.randn(256, 512, device="cuda"))
    x = torch.randn(40, 512, device="cuda").bfloat16()
    try:
        monkeypatch.delenv("KVRAY_TORCH_KERNELS", raising=False)
        kernels.read_kernel_switch()
        assert torch.equal(kernels.fp8_linear(x, q, scale), fp8_linear_triton(x, q, scale))
        out = kernels.fp8_block_linear(x, qb, scale_inv)
        assert torch.equal(out, fp8_block_linear_triton(x, qb, scale_inv))
        x32 = x.float()  # float32 activations: the reference on a GPU too
        assert torch.equal(kernels.fp8_linear(x32, q, scale), fp8_linear_ref(x32, q, scale))
        monkeypatch.setenv("KVRAY_TORCH_KERNELS", "1")
        kernels.read_kernel_switch()
        assert torch.equal(kernels.fp8_linear(x, q, scale), fp8_linear_ref(x, q, scale))
        out = kernels.fp8_block_linear(x, qb, scale_inv)
        assert torch.equal(out, fp8_block_linear_ref(x, qb, scale_inv))
    finally:
        monkeypatch.undo()
        kernels.read_kernel_switch()


@gpu_test
def test_batch_sizes_past_the_first_of_each_tile_build_no_kernel_variant():
    from kernels.triton_fp8 import fp8_block_linear_triton, fp8_linear_triton
    from kernels.variants import new_kernel_variants

    n, k = 512, 1024
    q, scale = quantize_fp8(torch.randn(n, k, device="cuda") / k**0.5, per_channel=True)
    qb, scale_inv = quantize_fp8_block(torch.randn(n, k, device="cuda") / k**0.5)

    def run(m: int) -> None:
        x = torch.randn(m, k, device="cuda").bfloat16()
        fp8_linear_triton(x, q, scale)
        fp8_block_linear_triton(x, qb, scale_inv)

    for m in (1, 2, W8A16_MAX_TOKENS + 1, 65):  # one of each tile
        run(m)
    with new_kernel_variants() as built:
        for m in (3, 16, 32, 40, 64, 100, 256, 300):
            run(m)
    assert built == []
