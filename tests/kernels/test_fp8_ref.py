"""The FP8 torch references (kernels/fp8_ref.py) against plain float computations, on CPU."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.fp8_ref import (
    FP8_DTYPE,
    W8A16_MAX_TOKENS,
    dequantize_fp8_block,
    fp8_block_linear_ref,
    fp8_linear_ref,
    quantize_fp8,
    quantize_fp8_block,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group,
)

LARGE_M = W8A16_MAX_TOKENS + 4


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def assert_rounded_to_e4m3(original: torch.Tensor, q: torch.Tensor, scale: torch.Tensor):
    """Each q * scale is original rounded to e4m3 at that scale: within half a step, which
    is 2^-4 of the value in the normal range and 2^-10 * scale below it."""
    assert q.dtype == FP8_DTYPE
    error = (q.float() * scale - original.float()).abs()
    assert (error <= original.float().abs() * 2**-4 + scale * 2**-10 + 1e-12).all()


def test_quantize_fp8_per_channel_scales_each_row_by_its_amax():
    w = torch.randn(6, 40) * torch.tensor([1e-3, 0.1, 1, 10, 300, 1e4])[:, None]
    q, scale = quantize_fp8(w, per_channel=True)
    assert scale.dtype == torch.float32 and scale.shape == (6,)
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / 448, rtol=1e-6, atol=0)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((6,), 448.0))
    assert_rounded_to_e4m3(w, q, scale[:, None])


def test_quantize_fp8_per_tensor_has_one_scale():
    w = torch.randn(5, 33) * 7
    q, scale = quantize_fp8(w, per_channel=False)
    assert scale.shape == (1,)
    torch.testing.assert_close(scale[0], w.abs().max() / 448, rtol=1e-6, atol=0)
    assert q.float().abs().max() == 448
    assert_rounded_to_e4m3(w, q, scale)


def test_zero_rows_quantize_to_zero_with_a_finite_scale():
    w = torch.randn(3, 16)
    w[1] = 0
    q, scale = quantize_fp8(w, per_channel=True)
    assert torch.equal(q[1].float(), torch.zeros(16))
    assert torch.isfinite(scale).all() and (scale > 0).all()
    x = torch.zeros(2, 16)
    qx, sx = quantize_fp8_per_token(x)
    assert torch.equal(qx.float(), x) and (sx > 0).all()


def test_quantize_fp8_rejects_a_vector():
    with pytest.raises(ValueError, match="weight"):
        quantize_fp8(torch.randn(8), per_channel=True)


def test_per_token_quantization_scales_each_row():
    x = torch.randn(4, 50) * torch.tensor([0.01, 1, 5, 100])[:, None]
    q, scale = quantize_fp8_per_token(x)
    assert scale.shape == (4, 1)
    for row in range(4):
        assert scale[row, 0] == x[row].abs().max() / 448
        assert q[row].float().abs().max() == 448
    assert_rounded_to_e4m3(x, q, scale)


def test_per_token_group_quantization_scales_each_group_of_each_row():
    group = 16
    x = torch.randn(3, 40) * 3  # groups of 16, 16 and 8 columns
    q, scale = quantize_fp8_per_token_group(x, group)
    assert scale.shape == (3, 3)
    for row in range(3):
        for g in range(3):
            cols = slice(g * group, min((g + 1) * group, 40))
            assert scale[row, g] == x[row, cols].abs().max() / 448
            assert_rounded_to_e4m3(x[row, cols], q[row, cols], scale[row, g])


def test_block_quantization_has_one_scale_per_block_edges_included():
    w = torch.randn(70, 100)
    q, scale_inv = quantize_fp8_block(w, (32, 64))
    assert scale_inv.shape == (3, 2)
    deq = dequantize_fp8_block(q, scale_inv, (32, 64))
    for i in range(3):
        for j in range(2):
            rows, cols = slice(32 * i, 32 * (i + 1)), slice(64 * j, 64 * (j + 1))
            assert scale_inv[i, j] == w[rows, cols].abs().max() / 448
            assert torch.equal(deq[rows, cols], q[rows, cols].float() * scale_inv[i, j])
            assert_rounded_to_e4m3(w[rows, cols], q[rows, cols], scale_inv[i, j])


def channel_weight(n: int, k: int, per_channel: bool):
    w = torch.randn(n, k) / k**0.5
    q, scale = quantize_fp8(w, per_channel)
    return w, q, scale


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
def test_decode_batches_multiply_16_bit_activations_by_the_dequantized_weight(
    per_channel, with_bias
):
    w, q, scale = channel_weight(48, 64, per_channel)
    x = torch.randn(W8A16_MAX_TOKENS, 64, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16) if with_bias else None
    out = fp8_linear_ref(x, q, scale, bias=bias)
    assert out.dtype == torch.bfloat16 and out.shape == (W8A16_MAX_TOKENS, 48)
    deq = torch.stack([q[n].float() * scale[n if per_channel else 0] for n in range(48)])
    expected = x.float() @ deq.T + (bias.float() if with_bias else 0)
    torch.testing.assert_close(out, expected.bfloat16())
    # fp8 weights stay near the float product
    exact = x.float() @ w.T + (bias.float() if with_bias else 0)
    assert (out.float() - exact).norm() < 0.05 * exact.norm()


def quantize_rows_naively(x: torch.Tensor, scales) -> torch.Tensor:
    """Row i rounded to e4m3 at scales[i] (a float32 value; saturating), back in float32."""
    rows = []
    for row, s in zip(x.float(), scales, strict=True):
        rows.append((row / s).clamp(-448, 448).to(FP8_DTYPE).float() * s)
    return torch.stack(rows)


def test_larger_batches_quantize_activations_per_token():
    _, q, scale = channel_weight(48, 64, True)
    x = (torch.randn(LARGE_M, 64) * torch.linspace(0.1, 10, LARGE_M)[:, None]).half()
    out = fp8_linear_ref(x, q, scale)
    scales = [row.abs().max() / 448 for row in x.float()]
    expected = quantize_rows_naively(x, scales) @ (q.float() * scale[:, None]).T
    torch.testing.assert_close(out, expected.half())
    weight_only = x.float() @ (q.float() * scale[:, None]).T
    assert not torch.allclose(out.float(), weight_only, atol=1e-3, rtol=1e-3)


def test_a_static_input_scale_quantizes_every_row_and_saturates():
    _, q, scale = channel_weight(32, 64, True)
    x = torch.randn(LARGE_M, 64, dtype=torch.bfloat16)
    x[3, 5] = 1000.0  # far past 448 * input_scale: saturates
    input_scale = torch.tensor(0.01)
    out = fp8_linear_ref(x, q, scale, input_scale=input_scale)
    expected = (
        quantize_rows_naively(x, torch.full((LARGE_M,), 0.01)) @ (q.float() * scale[:, None]).T
    )
    torch.testing.assert_close(out, expected.bfloat16())
    assert expected.isfinite().all()


def test_unaligned_weights_keep_16_bit_activations_at_any_batch():
    _, q, scale = channel_weight(40, 72, True)  # 72 % 16 != 0
    x = torch.randn(LARGE_M, 72)
    out = fp8_linear_ref(x, q, scale, input_scale=torch.tensor(0.5))
    torch.testing.assert_close(out, x @ (q.float() * scale[:, None]).T)


def test_leading_dimensions_are_kept():
    _, q, scale = channel_weight(32, 64, True)
    x = torch.randn(2, 15, 64)
    out = fp8_linear_ref(x, q, scale)
    assert out.shape == (2, 15, 32)
    assert torch.equal(out.reshape(30, 32), fp8_linear_ref(x.reshape(30, 64), q, scale))


@pytest.mark.parametrize("num_tokens", [3, LARGE_M])
def test_block_linear_dequantizes_blocks_and_quantizes_larger_batches_per_group(num_tokens):
    n, k, block = 70, 100, (32, 64)
    w = torch.randn(n, k) / k**0.5
    q, scale_inv = quantize_fp8_block(w, block)
    x = torch.randn(num_tokens, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    out = fp8_block_linear_ref(x, q, scale_inv, bias, block)
    deq = torch.empty(n, k)
    for i in range(n):
        for j in range(k):
            deq[i, j] = q[i, j].float() * scale_inv[i // 32, j // 64]
    a = x.float()
    if num_tokens > W8A16_MAX_TOKENS:
        groups = [a[:, :64], a[:, 64:]]
        a = torch.cat([quantize_rows_naively(g, g.abs().amax(1) / 448) for g in groups], 1)
    torch.testing.assert_close(out, (a @ deq.T + bias.float()).bfloat16())


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda x, q, s: fp8_linear_ref(x, q.float(), s), "weight"),
        (lambda x, q, s: fp8_linear_ref(x[:, :30], q, s), "x"),
        (lambda x, q, s: fp8_linear_ref(x, q, s[:5]), "weight_scale"),
        (lambda x, q, s: fp8_linear_ref(x, q, s, bias=torch.zeros(3)), "bias"),
        (lambda x, q, s: fp8_linear_ref(x, q, s, input_scale=torch.ones(2)), "input_scale"),
        (lambda x, q, s: fp8_block_linear_ref(x, q, torch.ones(2, 2)), "weight_scale_inv"),
        (lambda x, q, s: fp8_block_linear_ref(x, q, torch.ones(1, 1), block=(0, 128)), "block"),
    ],
)
def test_bad_arguments_raise_naming_the_field(call, field):
    _, q, scale = channel_weight(32, 64, True)
    with pytest.raises(ValueError, match=f"^{field} "):
        call(torch.randn(2, 64), q, scale)


def test_cpu_tensors_take_the_fp8_references():
    _, q, scale = channel_weight(32, 64, True)
    for x in (torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(LARGE_M, 64)):
        assert torch.equal(kernels.fp8_linear(x, q, scale), fp8_linear_ref(x, q, scale))
    qb, scale_inv = quantize_fp8_block(torch.randn(32, 64), (16, 32))
    x = torch.randn(LARGE_M, 64, dtype=torch.bfloat16)
    out = kernels.fp8_block_linear(x, qb, scale_inv, block=(16, 32))
    assert torch.equal(out, fp8_block_linear_ref(x, qb, scale_inv, block=(16, 32)))
    assert kernels.quantize_fp8 is quantize_fp8
