"""The fp8 KV cache's kernels.

CPU (CI): the torch references against float computations; the Triton kernels against the
references in Triton's interpreter. GPU (`-m gpu`): the same, bf16 included, and what the
interpreter cannot show.

Triton's interpreter reads float8 right but rounds float32 to float8 wrongly (a carry into
the exponent halves the value, halfway cases round up, subnormals flush to zero): its store
tests store values that float8 holds exactly, saturated ones included; the rounding of
arbitrary values is checked on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention_ref import (
    FP8_MAX,
    dequantize_kv_ref,
    paged_attention_ref,
    quantize_kv_ref,
    store_kv_ref,
)
from kernels.rotary_ref import rotary_store_kv_ref

FP8 = torch.float8_e4m3fn
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
# The interpreter computes bfloat16 dots wrongly: bfloat16 cases run on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
HALF = torch.bfloat16 if HAS_CUDA else torch.float16
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(fn))


def triton_test(fn):
    """Marked `gpu` on a GPU machine; interpreted on CPU otherwise."""
    return pytest.mark.gpu(fn) if HAS_CUDA else fn


def param_id(value) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=DEVICE)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def exact_fp8_values(shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """Every finite float8 value (subnormals included) at random, times `scale` (a power of
    two, so that x / scale is exact), and a few values past the saturation limit."""
    codes = torch.randint(0, 256, shape, dtype=torch.uint8)
    values = codes.view(FP8).float()
    values = torch.where(values.isnan(), 1000.0 * torch.sign(torch.randn(shape)), values)
    return (values * scale).to(DEVICE)


def kv_rows(num_tokens: int, num_kv_heads: int, head_dim: int, dtype, values) -> tuple:
    """key and value [T, Hkv, D] as strided views of one fused qkv row, as the model has them."""
    num_heads = 2 * num_kv_heads
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    qkv[:, q_end:] = values.reshape(num_tokens, -1)
    qkv = qkv.to(dtype)
    shape = (num_tokens, num_kv_heads, head_dim)
    return (
        qkv[:, :q_end].view(num_tokens, num_heads, head_dim),
        qkv[:, q_end:k_end].view(shape),
        qkv[:, k_end:].view(shape),
    )


def slots_of(num_tokens: int, num_slots: int) -> torch.Tensor:
    slots = torch.randperm(num_slots, device=DEVICE)[:num_tokens]
    slots[::5] = -1  # padding rows store nothing
    return slots


# -- the references ---------------------------------------------------------------------


def test_fp8_store_ref_keeps_each_value_within_half_a_step_and_saturates():
    x = torch.randn(4000) * 10.0 ** torch.empty(4000).uniform_(-4, 3)
    k_scale = torch.tensor(0.37)
    stored = quantize_kv_ref(x, FP8, k_scale)
    read = dequantize_kv_ref(stored, k_scale)
    y = x / k_scale
    inside = y.abs() <= FP8_MAX
    # Half a step of e4m3: 2^-4 of the value in the normal range, 2^-10 among subnormals.
    half_step = torch.maximum(y.abs() * 2.0**-4, torch.tensor(2.0**-10)) * k_scale
    assert inside.sum() > 3000 and (~inside).sum() > 50
    assert ((read - x).abs() <= half_step * (1 + 1e-6))[inside].all()
    assert torch.equal(read[~inside], torch.sign(x[~inside]) * FP8_MAX * k_scale)
    # Another cache dtype casts and ignores the scale.
    assert torch.equal(quantize_kv_ref(x, torch.bfloat16, k_scale), x.to(torch.bfloat16))


def test_fp8_attention_ref_reads_stored_times_scale_close_to_float_attention():
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    q_lens, ctx_lens = [1, 1, 23, 7], [40, 0, 9, 70]
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    num_blocks = 1 + sum(-(-s // block_size) for s in seq_lens)
    tables = torch.randperm(num_blocks - 1)[: num_blocks - 1].add(1).int()
    widths = [-(-s // block_size) for s in seq_lens]
    block_tables = torch.zeros(len(seq_lens), max(widths), dtype=torch.int32)
    for i, start in enumerate(torch.tensor([0, *widths]).cumsum(0)[:-1].tolist()):
        block_tables[i, : widths[i]] = tables[start : start + widths[i]]
    slot_mapping = torch.cat(
        [
            block_tables[i, torch.arange(s) // block_size] * block_size
            + torch.arange(s) % block_size
            for i, s in enumerate(seq_lens)
        ]
    )
    key = torch.randn(len(slot_mapping), num_kv_heads, head_dim) * 30
    value = torch.randn(len(slot_mapping), num_kv_heads, head_dim) * 0.2
    k_scale, v_scale = torch.tensor(30 * 4 / FP8_MAX), torch.tensor(0.2 * 4 / FP8_MAX)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    fp8_cache, float_cache = torch.zeros(shape, dtype=FP8), torch.zeros(shape)
    store_kv_ref(key, value, fp8_cache, slot_mapping, k_scale, v_scale)
    store_kv_ref(key, value, float_cache, slot_mapping)
    batch = dict(
        query=torch.randn(sum(q_lens), num_heads, head_dim) / 30,
        query_start_loc=torch.tensor([0, *q_lens]).cumsum(0).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        scale=head_dim**-0.5,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    got = paged_attention_ref(**batch, kv_cache=fp8_cache, k_scale=k_scale, v_scale=v_scale)
    dequantized = torch.stack(
        [dequantize_kv_ref(fp8_cache[0], k_scale), dequantize_kv_ref(fp8_cache[1], v_scale)]
    )
    torch.testing.assert_close(got, paged_attention_ref(**batch, kv_cache=dequantized))
    # Against the float cache: an output row is an average of values (|v| < 0.8 here, whose
    # half float8 step is 0.05 at most), weighted by scores off by a few percent.
    exact = paged_attention_ref(**batch, kv_cache=float_cache)
    torch.testing.assert_close(got, exact, atol=0.05, rtol=0)
    assert (got - exact).abs().mean() < 5e-3  # 2.5% of the values' spread


# -- Triton against the references ----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@triton_test
def test_triton_store_kv_fp8_equals_the_reference_on_exact_values(dtype):
    from kernels.triton_attention import store_kv_triton

    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 37, 3, 64, 6, 16
    k_scale, v_scale = 0.25, 4.0
    values = torch.cat(
        [
            exact_fp8_values((num_tokens, num_kv_heads * head_dim), k_scale),
            exact_fp8_values((num_tokens, num_kv_heads * head_dim), v_scale),
        ],
        dim=1,
    )
    _, key, value = kv_rows(num_tokens, num_kv_heads, head_dim, dtype, values)
    slots = slots_of(num_tokens, num_blocks * block_size)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(FP8)
    expected = cache.clone()
    scales = (scalar(k_scale), scalar(v_scale))
    store_kv_ref(key, value, expected, slots, *scales)
    store_kv_triton(key, value, cache, slots, *scales)
    assert same_bits(cache, expected)
    assert (expected.float().abs() == FP8_MAX).any(), "no value saturated"


@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@triton_test
def test_triton_rotary_store_kv_fp8_at_position_zero_equals_the_reference(dtype):
    # Position 0 turns by nothing (cos 1, sin 0): the rotated keys stay exact float8 values.
    from kernels.triton_rotary import rotary_store_kv_triton

    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 21, 2, 64, 4, 16
    values = torch.cat([exact_fp8_values((num_tokens, num_kv_heads * head_dim), 2.0)] * 2, 1)
    qkv = kv_rows(num_tokens, num_kv_heads, head_dim, dtype, values)
    expected_qkv = [t.clone() for t in qkv]
    cos_sin = torch.cat([torch.ones(8, head_dim // 2), torch.zeros(8, head_dim // 2)], 1)
    cos_sin, positions = (
        cos_sin.to(DEVICE),
        torch.zeros(num_tokens, dtype=torch.long, device=DEVICE),
    )
    slots = slots_of(num_tokens, num_blocks * block_size)
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(FP8)
    expected = cache.clone()
    scales = (scalar(2.0), scalar(0.5))
    rotary_store_kv_ref(positions, *expected_qkv, cos_sin, expected, slots, *scales)
    rotary_store_kv_triton(positions, *qkv, cos_sin, cache, slots, *scales)
    assert same_bits(cache, expected)
    assert torch.equal(qkv[1], expected_qkv[1])


def fp8_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16):
    """A ragged batch over an fp8 cache in random block order (block 0 and the slots past
    each request's end hold NaN), with k_scale 0.6 and v_scale 1.7."""
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    widths = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(widths)
    order = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(widths) + 2, dtype=torch.int32)
    for i, width in enumerate(widths):
        tables[i, :width] = torch.tensor(order[:width], dtype=torch.int32)
        order = order[width:]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 3
    cache[:, 0] = float("nan")
    for i, s in enumerate(seq_lens):
        cache[:, tables[i, widths[i] - 1], s % block_size or block_size :] = float("nan")
    return dict(
        query=torch.randn(sum(q_lens), num_heads, head_dim).to(DEVICE, dtype),
        kv_cache=cache.to(FP8).to(DEVICE),
        query_start_loc=torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        scale=head_dim**-0.5,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        k_scale=scalar(0.6),
        v_scale=scalar(1.7),
    )


FP8_SCENARIOS = {
    "decode": ([1] * 5, [0, 15, 130, 300, 47], None),
    "decode-split": ([1] * 3, [700, 5, 260], 3),
    "prefill": ([40, 9, 1], [0, 33, 80], None),
    "mixed": ([1, 1, 30, 1, 6], [90, 3, 20, 200, 0], None),
}


@pytest.mark.parametrize("scenario", list(FP8_SCENARIOS))
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,dtype",
    [(8, 2, torch.float32), (4, 4, torch.float16)]
    + ([(32, 8, torch.bfloat16), (16, 1, torch.bfloat16)] if HAS_CUDA else []),
    ids=param_id,
)
@triton_test
def test_triton_paged_attention_reads_fp8_times_its_scales(
    scenario, num_heads, num_kv_heads, dtype
):
    from kernels.triton_attention import paged_attention_triton

    q_lens, ctx_lens, num_splits = FP8_SCENARIOS[scenario]
    batch = fp8_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, 64, dtype)
    want = paged_attention_ref(**batch)
    decodes = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    got = paged_attention_triton(**batch, num_decodes=decodes, num_splits=num_splits)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])
    # The scales matter: without them the output is another.
    unscaled = paged_attention_ref(**{**batch, "k_scale": None, "v_scale": None})
    assert not torch.allclose(unscaled.float(), want.float(), **TOLERANCES[dtype])


# -- GPU only -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=param_id)
@gpu_test
def test_triton_fp8_stores_round_as_the_reference(dtype):
    from kernels.triton_attention import store_kv_triton
    from kernels.triton_rotary import rotary_store_kv_triton

    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 300, 8, 128, 30, 16
    values = torch.randn(num_tokens, 2 * num_kv_heads * head_dim, device=DEVICE) * 100
    scales = (scalar(0.37), scalar(0.0123))  # values reach past 448 * scale: some saturate
    slots = slots_of(num_tokens, num_blocks * block_size)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    for with_rotary in (False, True):
        qkv = kv_rows(num_tokens, num_kv_heads, head_dim, dtype, values)
        expected_qkv = [t.clone() for t in qkv]
        cache = torch.zeros(shape, device=DEVICE).to(FP8)
        expected = cache.clone()
        if with_rotary:
            positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
            angles = torch.arange(4096, device=DEVICE)[:, None] * 1e-3
            angles = angles * torch.arange(head_dim // 2, device=DEVICE)
            cos_sin = torch.cat([angles.cos(), angles.sin()], 1)
            rotary_store_kv_ref(positions, *expected_qkv, cos_sin, cache.clone(), slots, *scales)
            rotary_store_kv_triton(positions, *qkv, cos_sin, cache, slots, *scales)
            # The rotation may round apart by an ulp (fused multiply-adds); the store must
            # write the key as the kernel rotated it.
            torch.testing.assert_close(qkv[1], expected_qkv[1], **TOLERANCES[dtype])
        else:
            store_kv_triton(*qkv[1:], cache, slots, *scales)
        store_kv_ref(*qkv[1:], expected, slots, *scales)
        assert same_bits(cache, expected), f"rotary={with_rotary}"
        assert (expected.float().abs() == FP8_MAX).any()


@gpu_test
def test_fp8_attention_reads_its_scales_at_each_graph_replay():
    from kernels.triton_attention import paged_attention_triton

    batch = fp8_paged_batch([1] * 8, [100, 900, 5, 2000, 64, 1, 333, 1500], 32, 8, 128, HALF)
    batch["max_seq_len"] = 2048
    paged_attention_triton(**batch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(**batch)
    for k, v in ((0.6, 1.7), (0.05, 3.0), (2.5, 0.01)):
        batch["k_scale"].fill_(k)
        batch["v_scale"].fill_(v)
        graph.replay()
        torch.testing.assert_close(out, paged_attention_ref(**batch), **TOLERANCES[HALF])


@gpu_test
def test_after_the_fp8_decode_warm_up_no_split_count_compiles_a_kernel():
    from kernels import warm_up_decode
    from kernels.triton_attention import DECODE_MAX_SPLITS, paged_attention_triton
    from kernels.variants import new_kernel_variants

    batch = fp8_paged_batch([1] * 3, [15, 1000, 2049], 32, 8, 128, HALF)
    warm_up_decode(batch["kv_cache"], num_heads=32, scale=batch["scale"], dtype=HALF)
    with new_kernel_variants() as compiled:
        for num_splits in range(1, DECODE_MAX_SPLITS + 1):
            paged_attention_triton(**batch, num_splits=num_splits)
    assert compiled == []
