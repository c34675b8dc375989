"""Weight-only quantized linear layers: the layout's reference (kernels/woq_ref.py), the
AWQ / GPTQ repackers (engine/layers/quantization/int4_packing.py) against the reference
quantizers of tests/support/quantizers.py, and the Triton kernels (kernels/triton_woq)
against the reference: interpreted on a CPU, on the GPU under `-m gpu`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from engine.layers.quantization.int4_packing import (
    AWQ_ORDER,
    awq_to_woq,
    gptq_to_woq,
    pack_int32,
    unpack_int32,
)
from kernels.woq_ref import (
    check_woq,
    woq_dequantize,
    woq_linear_ref,
    woq_pack,
    woq_quantize_rtn,
    woq_unpack,
)
from tests.support.quantizers import awq_quantize, gptq_quantize

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def triton_test(fn):
    """Marked `gpu` on a GPU machine; run in Triton's interpreter on a CPU otherwise."""
    return pytest.mark.gpu(fn) if HAS_CUDA else fn


def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(fn))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------- the layout's reference


def test_dequantize_reads_low_nibble_first_and_each_groups_scale_and_min():
    # One row, K = 32, two groups of 16: codes 0..15 then 15..0.
    codes = torch.cat([torch.arange(16), torch.arange(15, -1, -1)]).view(1, 32)
    qweight = woq_pack(codes, 4)
    assert qweight.tolist()[0][:2] == [0x10, 0x32]  # q[0] low nibble, q[1] high nibble
    assert qweight.tolist()[0][8] == 0xEF  # q[16] = 15 low, q[17] = 14 high
    scales = torch.tensor([[0.5, 2.0]], dtype=torch.float16)
    mins = torch.tensor([[-1.0, 3.0]], dtype=torch.float16)
    w = woq_dequantize(qweight, scales, mins, 4, 16)
    expected = [q * 0.5 - 1.0 for q in range(16)] + [q * 2.0 + 3.0 for q in range(15, -1, -1)]
    assert w.dtype == torch.float32 and w[0].tolist() == expected


def test_dequantize_8_bit_codes_are_bytes():
    codes = torch.tensor([[0, 1, 128, 255] * 4])
    qweight = woq_pack(codes, 8)
    assert qweight.tolist() == codes.tolist()
    w = woq_dequantize(
        qweight, torch.tensor([[0.25]]).half(), torch.tensor([[-32.0]]).half(), 8, 16
    )
    assert w[0, :4].tolist() == [-32.0, -31.75, 0.0, 31.75]


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_inverts_pack(bits):
    codes = torch.randint(0, 1 << bits, (5, 64), dtype=torch.uint8)
    assert torch.equal(woq_unpack(woq_pack(codes, bits), bits), codes)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(bits=3), "bits"),
        (dict(group_size=96), "group_size"),
        (dict(qweight=torch.zeros(4, 32, dtype=torch.int32)), "qweight"),
        (dict(scales=torch.zeros(4, 3, dtype=torch.float16)), "scales"),
        (dict(mins=torch.zeros(4, 4, dtype=torch.float32)), "mins"),
    ],
)
def test_check_woq_names_the_field_that_breaks_the_layout(change, field):
    args = dict(
        qweight=torch.zeros(4, 32, dtype=torch.uint8),
        scales=torch.zeros(4, 4, dtype=torch.float16),
        mins=torch.zeros(4, 4, dtype=torch.float16),
        bits=4,
        group_size=16,
    )
    with pytest.raises(ValueError, match=field):
        check_woq(**(args | change))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 128])
def test_rtn_quantizer_rounds_to_the_nearest_code_of_each_group(bits, group_size):
    w = torch.randn(6, 256)
    w[0, :group_size] = 0.75  # a constant group stays exact
    qweight, scales, mins = woq_quantize_rtn(w, bits, group_size)
    check_woq(qweight, scales, mins, bits, group_size)
    deq = woq_dequantize(qweight, scales, mins, bits, group_size)
    step = scales.float().repeat_interleave(group_size, dim=1)
    # half a step, plus the float16 rounding of the stored min
    bound = step / 2 + mins.float().abs().repeat_interleave(group_size, dim=1) * 2**-11
    assert bool(((deq - w).abs() <= bound + 1e-6).all())
    assert torch.equal(deq[0, :group_size], w[0, :group_size])
    codes = woq_unpack(qweight, bits).view(6, -1, group_size)
    assert bool((codes.amin(dim=2) == 0).all())  # each group's min is a code


def test_linear_ref_rounds_the_weight_to_the_activation_dtype():
    qweight, scales, mins = woq_quantize_rtn(torch.randn(8, 64), 4, 32)
    x, bias = torch.randn(3, 64).half(), torch.randn(8).half()
    w = woq_dequantize(qweight, scales, mins, 4, 32).half().float()
    expected = F.linear(x.float(), w, bias.float()).half()
    assert torch.equal(woq_linear_ref(x, qweight, scales, mins, 4, 32, bias), expected)


def test_cpu_woq_linear_uses_the_reference():
    qweight, scales, mins = woq_quantize_rtn(torch.randn(8, 64), 8, 64)
    x = torch.randn(2, 64).half()
    out = kernels.woq_linear(x, qweight, scales, mins, 8, 64)
    assert torch.equal(out, woq_linear_ref(x, qweight, scales, mins, 8, 64))


# ------------------------------------------------------------------------ the repackers


def test_int32_packing_round_trips_codes_that_set_the_sign_bit():
    codes = torch.randint(0, 16, (6, 16))
    codes[0, 7] = 15  # field 7 of word 0: the int32's top bits
    words = pack_int32(codes, 4, dim=1)
    assert words.dtype == torch.int32 and int(words[0, 0]) < 0
    assert torch.equal(unpack_int32(words, 4, dim=1), codes)
    assert torch.equal(unpack_int32(pack_int32(codes.t(), 4, dim=0), 4, dim=0), codes.t())


def _one_word(value: int) -> torch.Tensor:
    return torch.tensor([[value - (1 << 32) if value >= 1 << 31 else value]], dtype=torch.int32)


def test_awq_fields_go_to_outputs_in_its_interleaved_order():
    # Field i of the word holds i + 8 (field 0 lowest bits): output 8c + AWQ_ORDER[i] gets it.
    word = sum((i + 8) << (4 * i) for i in range(8))
    qweight = _one_word(word).repeat(16, 1)  # K = 16 rows, N = 8
    qzeros = _one_word(0x11111111)  # z = 1 everywhere
    scales = torch.ones(1, 8, dtype=torch.float16)
    qw, s, mins = awq_to_woq(qweight, qzeros, scales, 16)
    codes = woq_unpack(qw, 4)  # [N, K]
    assert codes[:, 0].tolist() == [AWQ_ORDER.index(n) + 8 for n in range(8)]
    assert codes[:, 0].tolist() == [8, 12, 9, 13, 10, 14, 11, 15]
    assert mins.tolist() == [[-1.0]] * 8 and torch.equal(s, scales.t())


def test_gptq_fields_go_to_consecutive_inputs_and_zeros_are_stored_minus_one():
    # Field i of word r is input 8r + i; qzeros packs outputs in plain order.
    word = sum(i << (4 * i) for i in range(8))
    qweight = _one_word(word).repeat(2, 8)  # K = 16, N = 8
    qzeros = _one_word(sum(n << (4 * n) for n in range(8)))  # stored z - 1 = n
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    qw, s, mins, perm = gptq_to_woq(qweight, qzeros, scales, None, 16)
    assert perm is None
    assert woq_unpack(qw, 4)[0].tolist() == list(range(8)) * 2
    assert mins[:, 0].tolist() == [-(n + 1) * 0.5 for n in range(8)]
    _, _, v2_mins, _ = gptq_to_woq(qweight, qzeros, scales, None, 16, zeros_stored_minus_one=False)
    assert v2_mins[:, 0].tolist() == [-n * 0.5 for n in range(8)]


def assert_repacked(qw, s, mins, ckpt, bits, group_size, perm=None):
    """The repacked layer holds the checkpoint's codes and scales exactly, its min is -z*s
    rounded once to float16, and so its weight is the format's own within that rounding."""
    codes, zeros, deq = ckpt.codes, ckpt.zeros, ckpt.dequantized
    if perm is not None:
        codes, deq = codes[:, perm], deq[:, perm]
    scales = ckpt.tensors["scales"].t()
    assert torch.equal(woq_unpack(qw, bits).long(), codes)
    assert torch.equal(s, scales)
    assert torch.equal(mins, (-(zeros.float() * scales.float())).half())
    w = woq_dequantize(qw, s, mins, bits, group_size)
    bound = (zeros.float() * scales.float()).repeat_interleave(group_size, dim=1) * 2**-11
    assert bool(((w - deq).abs() <= bound).all())


@pytest.mark.parametrize("group_size", [16, 32, 64, 128])
def test_awq_checkpoint_repacks_to_its_own_weight(group_size):
    ckpt = awq_quantize(torch.randn(48, 256), group_size)
    qw, s, mins = awq_to_woq(**ckpt.tensors, group_size=group_size)
    assert_repacked(qw, s, mins, ckpt, 4, group_size)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("minus_one", [True, False])
def test_gptq_checkpoint_repacks_to_its_own_weight(bits, group_size, sym, minus_one):
    ckpt = gptq_quantize(torch.randn(40, 256), group_size, bits, sym, False, minus_one)
    t = ckpt.tensors
    qw, s, mins, perm = gptq_to_woq(
        t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size, bits, minus_one
    )
    assert perm is None
    assert_repacked(qw, s, mins, ckpt, bits, group_size)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_act_order_permutes_inputs_so_the_product_is_the_checkpoints(bits):
    ckpt = gptq_quantize(torch.randn(40, 256), 32, bits, act_order=True, seed=3)
    t = ckpt.tensors
    assert not torch.equal(t["g_idx"].long(), torch.arange(256) // 32)
    qw, s, mins, perm = gptq_to_woq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 32, bits)
    assert perm is not None and torch.equal(t["g_idx"][perm].long(), torch.arange(256) // 32)
    assert_repacked(qw, s, mins, ckpt, bits, 32, perm)
    x = torch.randn(3, 256, dtype=torch.float64)
    w = woq_dequantize(qw, s, mins, bits, 32).double()
    # each weight is off by at most the float16 rounding of its min (|z * s| * 2**-11)
    zs = (ckpt.zeros.double() * t["scales"].t().double())[:, t["g_idx"].long()]
    bound = x.abs() @ (zs * 2**-11).t() + 1e-9
    assert bool(((x[:, perm] @ w.t() - x @ ckpt.dequantized.double().t()).abs() <= bound).all())


def test_gptq_g_idx_with_uneven_groups_is_refused():
    t = gptq_quantize(torch.randn(8, 64), 32).tensors
    g_idx = torch.zeros(64, dtype=torch.int32)
    g_idx[:8] = 1
    with pytest.raises(ValueError, match="g_idx"):
        gptq_to_woq(t["qweight"], t["qzeros"], t["scales"], g_idx, 32)


@pytest.mark.parametrize("name", ["qzeros", "scales"])
def test_repackers_name_the_mismatched_tensor(name):
    t = gptq_quantize(torch.randn(8, 64), 32).tensors
    bad = dict(t, **{name: t[name][:, :-1]})
    with pytest.raises(ValueError, match=name):
        gptq_to_woq(bad["qweight"], bad["qzeros"], bad["scales"], None, 32)
    a = awq_quantize(torch.randn(16, 64), 32).tensors
    with pytest.raises(ValueError, match=name):
        awq_to_woq(**dict(a, **{name: a[name][:, :-1]}), group_size=32)


# -------------------------------------------------------------------- the Triton kernels

TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
"""Relative error (Frobenius norm) against the reference: the outputs' rounding, and for
the GEMV (which multiplies by the unrounded weights) the weights' rounding to x's dtype."""


def assert_close_to_reference(out, x, layer, bias=None):
    qweight, scales, mins, bits, group_size = layer
    ref = woq_linear_ref(
        x.cpu(), qweight.cpu(), scales.cpu(), mins.cpu(), bits, group_size,
        None if bias is None else bias.cpu(),
    )  # fmt: skip
    assert out.shape == ref.shape and out.dtype == x.dtype
    err = (out.cpu().float() - ref.float()).norm() / ref.float().norm()
    assert err < TOLERANCE[x.dtype], f"relative error {err:.2e}"


def make_layer(n, k, bits, group_size):
    qweight, scales, mins = woq_quantize_rtn(torch.randn(n, k) / k**0.5, bits, group_size)
    return tuple(t.to(DEVICE) for t in (qweight, scales, mins)) + (bits, group_size)


# On a CPU the interpreter runs small layers; bfloat16 only where no dot is involved.
CPU_CASES = [(bits, g) for bits in (4, 8) for g in (16, 32, 64, 128)]


@pytest.mark.parametrize("bits,group_size", CPU_CASES)
@pytest.mark.parametrize("m", [1, 3])
@triton_test
def test_triton_woq_linear_matches_reference(bits, group_size, m):
    from kernels.triton_woq import woq_linear

    # On a CPU: whole tiles (unmasked kernels) at both M; other tests take the masks.
    n, k = (320, 1152) if HAS_CUDA else (24 if m == 1 else 128, 256)
    layer = make_layer(n, k, bits, group_size)
    for dtype in (torch.float16, torch.bfloat16) if HAS_CUDA or m == 1 else (torch.float16,):
        x = torch.randn(m, k, device=DEVICE).to(dtype)
        bias = torch.randn(n, device=DEVICE).to(dtype)
        assert_close_to_reference(woq_linear(x, *layer, bias), x, layer, bias)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,k", [(256, 1024), (320, 1152)])  # whole tiles; masked ones
@gpu_test
def test_woq_linear_on_the_gpu_matches_reference(bits, group_size, dtype, n, k):
    from kernels.triton_woq import woq_linear

    layer = make_layer(n, k, bits, group_size)
    for m in (1, 3, 16, 200):
        x = torch.randn(m, k, device=DEVICE).to(dtype)
        bias = torch.randn(n, device=DEVICE).to(dtype) if m == 3 else None
        assert_close_to_reference(woq_linear(x, *layer, bias), x, layer, bias)


@pytest.mark.parametrize("bits", [4, 8])
@triton_test
def test_split_k_programs_merge_launch_after_launch(bits):
    """Five GEMV tiles (32 chunks of 128 // bits inputs) in three splits (2, 2, 1), forty
    GEMM tiles in (14, 14, 12): the last program of each row block adds the partials and
    sets its counter back to zero for the next launch."""
    from kernels.triton_woq import GemmConfig, GemvConfig, woq_gemm, woq_gemv
    from kernels.triton_woq.common import split_counters

    n, k = 8, 5 * 32 * (128 // bits)
    layer = make_layer(n, k, bits, 64)
    gemv = GemvConfig(block_n=4, block_c=32, num_warps=1, split=3)
    gemm = GemmConfig(block_m=16, block_n=16, block_k=128, num_warps=4, num_stages=2, split=3)
    for _ in range(2):
        x = torch.randn(1, k, device=DEVICE).half()
        assert_close_to_reference(woq_gemv(x, *layer, config=gemv), x, layer)
        x = torch.randn(5, k, device=DEVICE).half()
        assert_close_to_reference(woq_gemm(x, *layer, config=gemm), x, layer)
        assert not split_counters(x.device, 1).any()


@pytest.mark.parametrize("bits", [4, 8])
@triton_test
def test_gemv_masks_a_ragged_last_tile_and_row_block(bits):
    from kernels.triton_woq import GemvConfig, woq_gemv

    k = 80 * (128 // bits)  # 2.5 tiles of 32 chunks
    layer = make_layer(21, k, bits, 32)  # 5.25 blocks of 4 rows
    x = torch.randn(1, k, device=DEVICE).half()
    out = woq_gemv(x, *layer, config=GemvConfig(block_n=4, block_c=32, num_warps=1, split=1))
    assert_close_to_reference(out, x, layer)


@pytest.mark.parametrize("bits", [4, 8])
@triton_test
def test_gemv_of_a_short_layer_takes_one_masked_tile_of_a_chunk_a_thread(bits):
    """K of a few chunks (the bundled model's 64 inputs): the default config still gives
    every thread a chunk (narrower tiles are miscompiled on the GPU), the rest masked."""
    from kernels.triton_woq import gemv_config, woq_linear

    for n, k in ((24, 64), (40, 256)):
        cfg = gemv_config(n, k, bits, 132)
        assert cfg.block_c >= 32 * cfg.num_warps
        layer = make_layer(n, k, bits, 16)
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(1, k, device=DEVICE).to(dtype)
            bias = torch.randn(n, device=DEVICE).to(dtype)
            assert_close_to_reference(woq_linear(x, *layer, bias), x, layer, bias)


@pytest.mark.parametrize("block_c, num_warps", [(8, 1), (32, 2)])
def test_gemv_refuses_tiles_of_fewer_chunks_than_threads(block_c, num_warps):
    from kernels.triton_woq import GemvConfig, woq_gemv

    layer = make_layer(8, 1024, 4, 32)
    x = torch.randn(1, 1024, device=DEVICE).half()
    with pytest.raises(ValueError, match="block_c"):
        woq_gemv(x, *layer, config=GemvConfig(4, block_c, num_warps, 1))


@triton_test
def test_one_row_with_k_off_the_gemv_chunks_takes_the_gemm():
    from kernels.triton_woq import woq_linear

    layer = make_layer(12, 48, 4, 16)  # 48 inputs: not whole 32-input chunks
    x = torch.randn(1, 48, device=DEVICE).half()
    assert_close_to_reference(woq_linear(x, *layer), x, layer)


@triton_test
def test_dequantize_kernel_writes_the_reference_weight():
    from kernels.triton_woq import woq_dequantize_triton

    for bits, group_size, n in ((4, 128, 40), (8, 16, 40), (4, 32, 64)):  # ragged, whole
        qweight, scales, mins, *_ = make_layer(n, 384 if n == 40 else 256, bits, group_size)
        w = woq_dequantize_triton(qweight, scales, mins, bits, group_size, torch.float16)
        ref = woq_dequantize(qweight.cpu(), scales.cpu(), mins.cpu(), bits, group_size).half()
        torch.testing.assert_close(w.cpu(), ref, atol=1e-3, rtol=1e-3)


@triton_test
def test_woq_linear_keeps_leading_dims_and_takes_empty_batches():
    from kernels.triton_woq import woq_linear

    layer = make_layer(16, 64, 4, 32)
    x = torch.randn(2, 1, 64, device=DEVICE).half()
    out = woq_linear(x, *layer)
    assert out.shape == (2, 1, 16)
    assert_close_to_reference(out.view(2, 16), x.view(2, 64), layer)
    assert woq_linear(x[:0], *layer).shape == (0, 1, 16)
    with pytest.raises(ValueError, match="x must be"):
        woq_linear(x.float(), *layer)


@gpu_test
def test_large_batches_dequantize_then_take_cublas():
    from kernels.triton_woq import DEQUANT_MIN_M, woq_linear

    layer = make_layer(256, 512, 4, 128)
    x = torch.randn(DEQUANT_MIN_M, 512, device=DEVICE).to(torch.bfloat16)
    assert_close_to_reference(woq_linear(x, *layer), x, layer)


@gpu_test
def test_woq_linear_replays_in_a_cuda_graph_with_new_inputs():
    from kernels.triton_woq import woq_linear

    layers = [make_layer(96, 4096, 4, 128), make_layer(4096, 4096, 8, 32)]  # split, no split
    for m in (1, 16):
        for layer in layers:
            x = torch.randn(m, layer[0].shape[1] * 8 // layer[3], device=DEVICE).bfloat16()
            woq_linear(x, *layer)  # compile and size the counters outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = woq_linear(x, *layer)
            for _ in range(2):
                x.copy_(torch.randn_like(x))
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, woq_linear(x, *layer))


@gpu_test
def test_cuda_woq_linear_dispatches_to_triton():
    from kernels.triton_woq import woq_linear

    layer = make_layer(64, 256, 4, 64)
    x = torch.randn(1, 256, device=DEVICE).half()
    assert torch.equal(kernels.woq_linear(x, *layer), woq_linear(x, *layer))
