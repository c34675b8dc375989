"""Kernel tests.

CPU (CI): the torch references against independent naive computations.
GPU (`-m gpu`, on the device): every Triton op against its reference on random inputs.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.activation_ref import silu_and_mul_ref
from kernels.attention_ref import paged_attention_ref, store_kv_ref
from kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary_ref import apply_rotary_ref

HAS_CUDA = torch.cuda.is_available()


def gpu_test(fn):
    """Marks a test `gpu` and skips it where CUDA is absent."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(fn))


# Triton kernels run on the GPU where there is one, else in Triton's interpreter on CPU
# tensors (tests/conftest.py sets TRITON_INTERPRET=1), so CI checks them too. The
# interpreter computes bfloat16 dots wrongly: bfloat16 cases run on the GPU only.
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
HALF = torch.bfloat16 if HAS_CUDA else torch.float16
BIG_BATCH = 256 if HAS_CUDA else 24


def triton_test(fn):
    """A Triton kernel test: marked `gpu` on a GPU machine; interpreted on CPU otherwise."""
    return pytest.mark.gpu(fn) if HAS_CUDA else fn


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def param_id(value) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_paged_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    share_prefix: bool = True,
    seed: int = 0,
) -> dict:
    """A ragged batch over a randomly laid out paged cache.

    Request i has ctx_lens[i] cached tokens and q_lens[i] new ones (already stored, as the
    attention contract says). Requests 0 and 1 share their common full blocks, and every
    slot that no request may read (null block 0, the tail of each last block) holds NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    blocks_per_req = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    # Two spare columns: tables are wider than any request needs, as in the engine.
    tables = torch.zeros(len(seq_lens), max(blocks_per_req) + 2, dtype=torch.int32)
    for i, n in enumerate(blocks_per_req):
        tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    if share_prefix and len(seq_lens) >= 2:
        shared = min(seq_lens[0], seq_lens[1]) // block_size
        tables[1, :shared] = tables[0, :shared]
    kv_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_gen = torch.Generator(device).manual_seed(seed)
    kv_cache = torch.randn(kv_shape, generator=kv_gen, device=device)
    kv_cache[:, 0] = float("nan")
    for i, s in enumerate(seq_lens):
        if s % block_size:
            kv_cache[:, tables[i, blocks_per_req[i] - 1], s % block_size :] = float("nan")
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        query=query.to(device, dtype),
        kv_cache=kv_cache.to(dtype),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        scale=head_dim**-0.5,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def sdpa_oracle(batch: dict) -> torch.Tensor:
    """Per request: gather its K/V contiguously and run SDPA with a causal offset mask."""
    query, kv_cache = batch["query"], batch["kv_cache"]
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    group = query.shape[1] // num_kv_heads
    starts = batch["query_start_loc"].tolist()
    out = torch.empty_like(query)
    for i, seq_len in enumerate(batch["seq_lens"].tolist()):
        q = query[starts[i] : starts[i + 1]]
        q_len = q.shape[0]
        slots = [
            int(batch["block_tables"][i, pos // block_size]) * block_size + pos % block_size
            for pos in range(seq_len)
        ]
        flat = kv_cache.reshape(2, -1, num_kv_heads, head_dim)[:, slots]
        k = flat[0].repeat_interleave(group, dim=1).transpose(0, 1).double()
        v = flat[1].repeat_interleave(group, dim=1).transpose(0, 1).double()
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = torch.arange(seq_len)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).double(), k, v, attn_mask=mask, scale=batch["scale"]
        )
        out[starts[i] : starts[i + 1]] = o.transpose(0, 1).to(query.dtype)
    return out


def run_ref(batch: dict) -> torch.Tensor:
    return paged_attention_ref(**batch)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(4, 4, 64, 16), (9, 3, 64, 16), (8, 2, 128, 16), (16, 2, 64, 32)],
)
def test_paged_attention_ref_matches_sdpa(num_heads, num_kv_heads, head_dim, block_size):
    # Fresh prompts, prefill chunks over cached prefixes, decodes; lengths off the block grid.
    q_lens = [23, 1, 7, 1, 40, 1]
    ctx_lens = [37, 70, 0, 0, 16, 129]
    batch = make_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size)
    out = run_ref(batch)
    assert not out.isnan().any()
    torch.testing.assert_close(out, sdpa_oracle(batch), atol=1e-5, rtol=1e-5)


def test_paged_attention_ref_shared_prefix_blocks_give_same_prefix_attention():
    # Two requests whose tables point at the same prefix blocks see the same prefix: their
    # first-token queries, made equal, produce equal outputs.
    batch = make_paged_batch([1, 1], [31, 31], 4, 2, 64, share_prefix=False)
    batch["block_tables"][1] = batch["block_tables"][0]
    batch["query"][1] = batch["query"][0]
    out = run_ref(batch)
    torch.testing.assert_close(out[0], out[1])


def test_paged_attention_ref_ignores_padding_rows_of_block_table():
    batch = make_paged_batch([3, 1], [20, 50], 4, 2, 64)
    expected = run_ref(batch)
    batch["block_tables"][:, -2:] = 12345  # past every request's last block
    torch.testing.assert_close(run_ref(batch), expected)


def test_store_kv_ref_writes_slots_and_skips_negative():
    num_kv_heads, head_dim, block_size = 3, 8, 4
    kv_cache = torch.randn(2, 5, block_size, num_kv_heads, head_dim)
    before = kv_cache.clone()
    # key/value as strided views of a fused qkv projection, as the model produces them.
    qkv = torch.randn(6, (6 + 2 * num_kv_heads) * head_dim)
    key = qkv[:, 6 * head_dim : 9 * head_dim].view(6, num_kv_heads, head_dim)
    value = qkv[:, 9 * head_dim :].view(6, num_kv_heads, head_dim)
    slot_mapping = torch.tensor([5, -1, 19, 0, -1, 8])
    store_kv_ref(key, value, kv_cache, slot_mapping)
    expected = before.clone()
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = key[t]
            expected[1, slot // block_size, slot % block_size] = value[t]
    assert torch.equal(kv_cache, expected)


def test_store_kv_ref_converts_to_cache_dtype():
    kv_cache = torch.zeros(2, 2, 4, 1, 8, dtype=torch.bfloat16)
    key = torch.randn(1, 1, 8)
    store_kv_ref(key, -key, kv_cache, torch.tensor([6]))
    assert torch.equal(kv_cache[0, 1, 2], key[0].to(torch.bfloat16))
    assert torch.equal(kv_cache[1, 1, 2], (-key[0]).to(torch.bfloat16))


def make_cos_sin_cache(max_position: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def rotary_complex(x: torch.Tensor, positions: torch.Tensor, head_dim: int, base: float):
    """Rotate-half rope as complex multiplication: (x_j + i x_{j+D/2}) * e^{i pos theta_j}."""
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rot = torch.polar(torch.ones(1, dtype=torch.float64), positions.double()[:, None] * inv_freq)
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rot[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_apply_rotary_ref_matches_complex_rotation_on_fused_qkv_views(head_dim):
    num_tokens, num_heads, num_kv_heads, base = 7, 9, 3, 10000.0
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    query = qkv[:, :q_end].view(num_tokens, num_heads, head_dim)
    key = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    q0, k0, v0 = query.clone(), key.clone(), qkv[:, k_end:].clone()
    positions = torch.tensor([0, 1, 5, 100, 4095, 17, 3])
    apply_rotary_ref(positions, query, key, make_cos_sin_cache(4096, head_dim, base))
    tol = dict(atol=1e-5, rtol=1e-5)  # float32 rounding of the cache and of the result
    torch.testing.assert_close(query.double(), rotary_complex(q0, positions, head_dim, base), **tol)
    torch.testing.assert_close(key.double(), rotary_complex(k0, positions, head_dim, base), **tol)
    assert torch.equal(qkv[:, k_end:], v0), "value columns of the fused tensor must not change"


def test_apply_rotary_ref_scores_depend_only_on_relative_position():
    head_dim = 64
    cache = make_cos_sin_cache(512, head_dim)
    q = torch.randn(1, 1, head_dim).expand(4, 1, head_dim).clone()
    k = torch.randn(1, 1, head_dim).expand(4, 1, head_dim).clone()
    apply_rotary_ref(torch.tensor([10, 110, 300, 13]), q, k.clone(), cache)
    k_rot = k.clone()
    apply_rotary_ref(torch.tensor([3, 103, 293, 0]), q.clone(), k_rot, cache)
    scores = (q * k_rot).sum(-1).flatten()  # query at p, key at p - 7 (last row: p - 13)
    torch.testing.assert_close(scores[:3], scores[0].expand(3), atol=1e-4, rtol=1e-4)
    assert not torch.isclose(scores[3], scores[0], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
def test_rms_norm_ref_matches_formula(dtype):
    x = (torch.randn(5, 576) * 3).to(dtype)
    weight = torch.randn(576)
    eps = 1e-5
    xd = x.double()
    expected = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    out = rms_norm_ref(x, weight, eps)
    assert out.dtype == dtype
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected, **tol)


def test_fused_add_rms_norm_ref_returns_norm_of_sum_and_sum():
    x, residual, weight = torch.randn(4, 96), torch.randn(4, 96), torch.randn(96)
    x0, r0 = x.clone(), residual.clone()
    normed, summed = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    s = x0.double() + r0.double()
    torch.testing.assert_close(summed.double(), s)
    expected = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    torch.testing.assert_close(normed.double(), expected)
    assert torch.equal(x, x0) and torch.equal(residual, r0), "inputs must not be mutated"


def test_silu_and_mul_ref_matches_formula():
    x = torch.randn(3, 2 * 40) * 4
    gate, up = x[:, :40].double(), x[:, 40:].double()
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_ref(x).double(), expected)


def test_cpu_tensors_use_the_references():
    assert not kernels.use_triton(torch.empty(1))
    batch = make_paged_batch([2, 1], [5, 9], 4, 2, 64)
    torch.testing.assert_close(kernels.paged_attention(**batch), run_ref(batch))


@pytest.mark.parametrize("name", ["attention", "norm", "rotary", "activation", "fp8"])
def test_triton_modules_import_without_a_gpu(name):
    pytest.importorskip("triton")
    module = importlib.import_module(f"kernels.triton_{name}")
    assert any(n.endswith("_triton") for n in dir(module))


@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_each_kernel_names_a_triton_function_and_a_reference(name):
    pytest.importorskip("triton")
    triton_function, reference = kernels.KERNELS[name]
    module, function = triton_function.split(":")
    assert callable(getattr(importlib.import_module(module), function)) and callable(reference)


def test_the_references_run_without_importing_triton():
    code = (
        "import sys, torch, kernels\n"
        "x = torch.randn(2, 8)\n"
        "kernels.rms_norm(x, torch.ones(8), 1e-6)\n"
        "kernels.silu_and_mul(x)\n"
        "kernels.linear(x[:1], torch.randn(4, 8))\n"
        "q, s = kernels.quantize_fp8(torch.randn(16, 8), per_channel=True)\n"
        "kernels.fp8_linear(x, q, s)\n"
        "kernels.fp8_block_linear(x, q, torch.ones(1, 1))\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8, 16, 32])
@pytest.mark.parametrize("float32", [False, True])
def test_prefill_tile_query_lens_reach_every_tile_size_at_its_shortest(group, float32):
    pytest.importorskip("triton")
    from kernels.triton_attention import prefill_block_m, prefill_tile_query_lens

    lens = prefill_tile_query_lens(group, float32)
    tile_of = {n: prefill_block_m(n, group, float32) for n in range(2, 4096)}
    assert sorted({tile_of[n] for n in lens}) == sorted(set(tile_of.values()))
    for n in lens:  # the first length that takes its tile
        assert all(tile_of[m] != tile_of[n] for m in range(2, n))


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "NaN in kernel output"
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[ref.dtype])


# (num_heads, num_kv_heads, head_dim, dtype): GQA 1/3/4/8 x D 64/128 in bf16, a spread of
# the same in fp16 and fp32, and two single-kv-head models.
ATTN_CONFIGS = [
    (h, kv, d, torch.bfloat16) for (h, kv) in [(4, 4), (9, 3), (32, 8), (16, 2)] for d in (64, 128)
] + [
    (8, 8, 128, torch.float16),
    (9, 3, 64, torch.float16),
    (32, 8, 128, torch.float16),
    (16, 2, 64, torch.float16),
    (9, 3, 64, torch.float32),
    (16, 2, 128, torch.float32),
    # MQA-like groups: more query rows per program than the usual tiles.
    (32, 1, 128, torch.bfloat16),
    (64, 1, 64, torch.float32),
]
ATTN_CONFIGS = [c for c in ATTN_CONFIGS if c[3] in DTYPES]


def scenario(kind: str, seed: int) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)

    def rand(lo: int, hi: int, n: int) -> list[int]:
        return torch.randint(lo, hi, (n,), generator=gen).tolist()

    if kind == "decode":
        num_seqs = 64 if HAS_CUDA else 12  # the interpreter runs one program at a time
        return [1] * num_seqs, rand(0, 700, num_seqs)
    if kind == "prefill":
        return rand(1, 150, 6), [0, *rand(0, 300, 5)]
    # Mixed: decodes interleaved with prefill chunks over cached prefixes.
    q_lens = [1, 1, 37, 1, 1, 90, 1, 1, 1, 5, 1, 1, 130, 1]
    ctx = rand(0, 400, len(q_lens))
    return q_lens, ctx


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,dtype", ATTN_CONFIGS, ids=param_id)
@triton_test
def test_triton_paged_attention(kind, num_heads, num_kv_heads, head_dim, dtype):
    from kernels.triton_attention import paged_attention_triton

    q_lens, ctx = scenario(kind, seed=head_dim + num_heads)
    batch = make_paged_batch(q_lens, ctx, num_heads, num_kv_heads, head_dim, 16, dtype, DEVICE)
    want = run_ref(batch)
    assert_matches(paged_attention_triton(**batch), want)
    if kind == "mixed":
        # The leading decodes split off to the decode kernel, as the model runner asks.
        assert_matches(paged_attention_triton(**batch, num_decodes=leading_decodes(q_lens)), want)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@triton_test
def test_paged_attention_writes_only_owned_rows_of_a_given_output(kind):
    """Piecewise CUDA graphs pad a step to a bucket: the query has rows past the last
    request's, and the output buffer is shared; those rows must stay as they were."""
    from kernels.triton_attention import paged_attention_triton

    q_lens, ctx = scenario(kind, seed=3)
    batch = make_paged_batch(q_lens, ctx, 8, 2, 64, 16, torch.float32, DEVICE)
    n, pad = batch["query"].shape[0], 7
    batch["query"] = torch.cat([batch["query"], torch.randn(pad, 8, 64, device=DEVICE)])
    want = run_ref({**batch, "query": batch["query"][:n]})
    for attend in (paged_attention_triton, paged_attention_ref, kernels.paged_attention):
        out = torch.full_like(batch["query"], 7.0)
        assert attend(**batch, out=out) is out
        assert_matches(out[:n], want)
        assert (out[n:] == 7.0).all(), f"{attend.__name__} wrote rows no request owns"
    decodes = leading_decodes(q_lens)
    out = torch.full_like(batch["query"], 7.0)
    paged_attention_triton(**batch, num_decodes=decodes, out=out)
    assert_matches(out[:n], want)
    assert (out[n:] == 7.0).all()


def leading_decodes(q_lens: list[int]) -> int:
    return next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))


@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([1], [0]),  # first decode step of a 1-token prompt
        ([1], [4500]),  # one long request: many context partitions
        ([1] * BIG_BATCH, list(range(3, BIG_BATCH * 5, 5))),
        ([1, 1], [2999, 20]),  # partitions past the short request's end
        ([300, 1], [0, 33]),  # prefill longer than one query tile
        ([1, 1, 1, 300, 1, 20], [4500, 7, 0, 64, 3, 900]),  # decodes first, then chunks
    ],
)
@pytest.mark.parametrize("block_size", [16, 32])
@triton_test
def test_triton_paged_attention_batch_shapes(q_lens, ctx_lens, block_size):
    from kernels.triton_attention import paged_attention_triton

    batch = make_paged_batch(q_lens, ctx_lens, 32, 8, 128, block_size, HALF, DEVICE)
    num_decodes = leading_decodes(q_lens)
    assert_matches(paged_attention_triton(**batch, num_decodes=num_decodes), run_ref(batch))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (8, 8)])
@triton_test
def test_triton_paged_decode_wide_tiles_for_small_groups(num_heads, num_kv_heads):
    # One split and <= 2 query heads per kv head: the decode reads keys in wider tiles.
    from kernels.triton_attention import paged_attention_triton

    q_lens, ctx = scenario("decode", seed=num_heads)
    batch = make_paged_batch(q_lens, ctx, num_heads, num_kv_heads, 128, 16, HALF, DEVICE)
    assert_matches(paged_attention_triton(**batch, num_splits=1), run_ref(batch))


@pytest.mark.parametrize("num_splits", [1, 3, 7, 64])
@triton_test
def test_triton_paged_decode_any_split_count(num_splits):
    from kernels.triton_attention import paged_attention_triton

    batch = make_paged_batch([1] * 5, [0, 15, 16, 1000, 2049], 9, 3, 64, 16, torch.float16, DEVICE)
    assert_matches(paged_attention_triton(**batch, num_splits=num_splits), run_ref(batch))


def test_decode_split_variants_cover_every_split_count_the_kernel_picks():
    pytest.importorskip("triton")
    import triton

    from kernels.triton_attention import decode_num_splits, decode_split_variants

    variants = {triton.next_power_of_2(n) for n in decode_split_variants()}
    for num_seqs in (1, 2, 3, 7, 64, 513):
        for num_kv_heads in (1, 8):
            for max_seq_len in (1, 511, 513, 4096, 131072):
                splits = decode_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms=132)
                assert triton.next_power_of_2(splits) in variants


@triton_test
def test_decode_warm_up_leaves_the_kernel_ready_for_real_batches():
    from kernels.triton_attention import paged_attention_triton

    batch = make_paged_batch([1] * 3, [15, 1000, 2049], 9, 3, 64, 16, torch.float16, DEVICE)
    kernels.warm_up_decode(batch["kv_cache"], num_heads=9, scale=batch["scale"])
    for num_splits in (1, 7):  # the merge counters were left at zero
        assert_matches(paged_attention_triton(**batch, num_splits=num_splits), run_ref(batch))


@gpu_test
def test_after_the_decode_warm_up_no_split_count_compiles_a_kernel():
    # Steps without CUDA graphs pick any split count from 1 to DECODE_MAX_SPLITS.
    from kernels.triton_attention import (
        DECODE_MAX_SPLITS,
        paged_attention_triton,
        warm_up_decode,
    )
    from kernels.variants import new_kernel_variants

    batch = make_paged_batch([1] * 3, [15, 1000, 2049], 32, 8, 128, 16, HALF, DEVICE)
    warm_up_decode(batch["kv_cache"], num_heads=32, scale=batch["scale"])
    with new_kernel_variants() as compiled:
        for num_splits in range(1, DECODE_MAX_SPLITS + 1):
            paged_attention_triton(**batch, num_splits=num_splits)
    assert compiled == []


@triton_test
def test_triton_paged_decode_spreads_short_contexts_over_a_graph_sized_grid():
    from kernels.triton_attention import paged_attention_triton

    # As a CUDA graph runs it: the grid and max_seq_len sized for 4096 tokens, contexts far
    # shorter, each spread over all 16 splits (including one shorter than a split each).
    batch = make_paged_batch([1] * 4, [5, 300, 64, 900], 8, 2, 64, 16, torch.float32, DEVICE)
    out = paged_attention_triton(**{**batch, "max_seq_len": 4096}, num_splits=16)
    assert_matches(out, run_ref(batch))


@gpu_test
def test_triton_paged_decode_merges_right_launch_after_launch():
    # The last partition of each (request, kv head) merges, found by a counter that every
    # launch must leave at zero for the next; back-to-back launches with other lengths.
    from kernels.triton_attention import paged_attention_triton

    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        ctx = torch.randint(0, 3000, (6,), generator=gen).tolist()
        batch = make_paged_batch([1] * 6, ctx, 32, 8, 128, 16, HALF, "cuda", seed=seed)
        out = paged_attention_triton(**{**batch, "max_seq_len": 4096}, num_splits=1 + seed % 16)
        assert_matches(out, run_ref(batch))


@gpu_test
def test_triton_paged_decode_replays_in_cuda_graph_with_new_lengths():
    from kernels.triton_attention import paged_attention_triton

    num_seqs, max_seq_len, block_size = 8, 2048, 16
    max_blocks = max_seq_len // block_size
    # Capture once with upper-bound metadata, then replay on other lengths and tables.
    static = make_paged_batch(
        [1] * num_seqs,
        [max_seq_len - 1] * num_seqs,
        32,
        8,
        128,
        block_size,
        HALF,
        "cuda",
        share_prefix=False,
    )
    static["kv_cache"].copy_(torch.randn_like(static["kv_cache"]))
    static["block_tables"] = static["block_tables"][:, :max_blocks].contiguous()
    paged_attention_triton(**static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(**static)
    num_blocks = static["kv_cache"].shape[1]
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        seq_lens = torch.randint(1, max_seq_len + 1, (num_seqs,), generator=gen)
        tables = torch.randint(1, num_blocks, (num_seqs, max_blocks), generator=gen)
        static["seq_lens"].copy_(seq_lens)
        static["block_tables"].copy_(tables)
        static["query"].copy_(torch.randn(static["query"].shape, generator=gen))
        graph.replay()
        ref = run_ref({**static, "max_seq_len": int(seq_lens.max())})
        assert_matches(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("num_tokens", [1, 37, 300])
@triton_test
def test_triton_store_kv(dtype, num_tokens):
    from kernels.triton_attention import store_kv_triton

    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 40
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    qkv = qkv.to(dtype)
    k_end = (num_heads + num_kv_heads) * head_dim
    key = qkv[:, num_heads * head_dim : k_end].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[::5] = -1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE)
    cache = cache.to(dtype)
    expected = cache.clone()
    store_kv_ref(key, value, expected, slots)
    store_kv_triton(key, value, cache, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("hidden", [576, 4096, 1000])
@triton_test
def test_triton_norms(dtype, hidden):
    from kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton

    # Rows strided inside a wider buffer, as a slice of a larger activation would be.
    x = (torch.randn(33, hidden + 8, device=DEVICE) * 3).to(dtype)[:, :hidden]
    residual = torch.randn(33, hidden, device=DEVICE).to(dtype)
    weight = torch.randn(hidden, device=DEVICE)
    x0, r0 = x.clone(), residual.clone()
    assert_matches(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    normed, summed = fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    ref_normed, ref_summed = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed)
    assert_matches(normed, ref_normed)
    assert torch.equal(x, x0) and torch.equal(residual, r0), "inputs must not be mutated"


@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
@triton_test
def test_triton_rotary_on_fused_qkv(dtype, num_heads, num_kv_heads, head_dim):
    from kernels.triton_rotary import apply_rotary_triton

    num_tokens = 77
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    qkv = qkv.to(dtype)
    expected = qkv.clone()
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim

    def views(t):
        q = t[:, :q_end].view(num_tokens, num_heads, head_dim)
        return q, t[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)

    cache = make_cos_sin_cache(8192, head_dim).to(DEVICE)
    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
    apply_rotary_ref(positions, *views(expected), cache)
    apply_rotary_triton(positions, *views(qkv), cache)
    assert_matches(qkv, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
@triton_test
def test_triton_rotary_store_kv_equals_rotary_then_store(dtype, num_heads, num_kv_heads, head_dim):
    from kernels.triton_rotary import rotary_store_kv_triton

    num_tokens, block_size, num_blocks = 37, 16, 12
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    qkv = qkv.to(dtype)
    expected_qkv = qkv.clone()
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim

    def views(t):
        return (
            t[:, :q_end].view(num_tokens, num_heads, head_dim),
            t[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim),
            t[:, k_end:].view(num_tokens, num_kv_heads, head_dim),
        )

    cos_sin = make_cos_sin_cache(4096, head_dim).to(DEVICE)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[::4] = -1  # padding rows store nothing
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE)
    cache = cache.to(dtype)
    expected_cache = cache.clone()
    q, k, v = views(expected_qkv)
    apply_rotary_ref(positions, q, k, cos_sin)
    store_kv_ref(k, v, expected_cache, slots)
    rotary_store_kv_triton(positions, *views(qkv), cos_sin, cache, slots)
    assert_matches(qkv, expected_qkv)
    assert_matches(cache, expected_cache)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    flat = cache.view(2, num_blocks * block_size, -1)[:, untouched.to(DEVICE)]
    assert torch.equal(
        flat, expected_cache.view(2, num_blocks * block_size, -1)[:, untouched.to(DEVICE)]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("inter", [1536, 14336, 100])
@triton_test
def test_triton_silu_and_mul(dtype, inter):
    from kernels.triton_activation import silu_and_mul_triton

    x = (torch.randn(29, 2 * inter, device=DEVICE) * 3).to(dtype)
    assert_matches(silu_and_mul_triton(x), silu_and_mul_ref(x))


def sampling_logits(
    rows: int, vocab: int, padded: int, chunk: int
) -> tuple[torch.Tensor, dict[int, float]]:
    """Rows of one distribution over a few tokens spread across the kernel's vocab chunks;
    every other token -inf, padding past `vocab` huge (it must never be picked)."""
    support = {3: 1.0, chunk - 1: 0.0, chunk: -0.5, vocab - 1: 0.7}
    logits = torch.full((rows, padded), float("-inf"))
    logits[:, vocab:] = 1e4
    for t, v in support.items():
        logits[:, t] = v
    return logits, support


# The interpreter runs one program at a time: on CPU one temperature and few rows.
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0] if HAS_CUDA else [0.7])
@triton_test
def test_triton_gumbel_sample_follows_softmax_of_scaled_logits(temperature):
    from kernels.triton_sampling import gumbel_sample_triton

    rows, vocab, chunk = (20000, 20000, 8192) if HAS_CUDA else (300, 2500, 1024)
    logits, support = sampling_logits(rows, vocab, vocab + 64, chunk)
    logits = logits.to(DEVICE, HALF if HAS_CUDA else torch.float32)
    temps = torch.full((rows, 1), temperature, device=DEVICE)
    ids = gumbel_sample_triton(logits, temps, None, 1234, vocab, chunk).cpu()
    assert ids.dtype == torch.int64 and ids.shape == (rows,)
    assert set(ids.tolist()) <= set(support)
    tokens = torch.tensor(list(support))
    expected = torch.softmax(torch.tensor(list(support.values())) / temperature, 0)
    counts = torch.stack([(ids == t).sum() for t in tokens]).float()
    sigma = (rows * expected * (1 - expected)).sqrt()
    assert ((counts - rows * expected).abs() <= 5 * sigma + 1).all(), (counts, rows * expected)
    # Another seed, other draws; the same seed, the same draws.
    again = gumbel_sample_triton(logits, temps, None, 1234, vocab, chunk).cpu()
    other = gumbel_sample_triton(logits, temps, None, 99, vocab, chunk).cpu()
    assert torch.equal(ids, again) and not torch.equal(ids, other)


@triton_test
def test_triton_gumbel_sample_greedy_rows_take_the_first_argmax():
    from kernels.triton_sampling import gumbel_sample_triton

    vocab = 2500
    logits = torch.randn(6, vocab)
    logits[:, 2100] = 50.0
    logits[0, 17] = 50.0  # a tie with a lower id: argmax's first
    greedy = torch.tensor([True, True, False, True, False, False])
    temps = torch.full((6, 1), 0.7)
    ids = gumbel_sample_triton(
        logits.to(DEVICE), temps.to(DEVICE), greedy.to(DEVICE), 5, vocab, chunk=1024
    ).cpu()
    assert ids[0] == 17 and ids[1] == 2100 and ids[3] == 2100
    # Random rows: the 50.0 logit outweighs the rest at T=0.7 but need not be the answer.
    assert all(0 <= i < vocab for i in ids.tolist())


@triton_test
def test_triton_argmax_equals_torch_argmax_with_ties_and_vocab_padding():
    from kernels.triton_sampling import argmax_triton

    vocab = 128256 if HAS_CUDA else 2500
    logits = torch.randn(5, vocab + 64).to(HALF if HAS_CUDA else torch.float32)
    logits[:, vocab:] = 1e4  # padding past the vocabulary never wins
    logits[1, [9000 % vocab, 2 * vocab // 3]] = 60.0  # a tie across chunks: the lower id
    logits[2, vocab - 1] = 60.0
    ids = argmax_triton(logits.to(DEVICE), vocab).cpu()
    assert ids.dtype == torch.int64
    assert ids.tolist() == logits[:, :vocab].float().argmax(dim=1).tolist()


@triton_test
def test_public_sampling_names_forward_to_the_triton_kernels():
    from kernels.triton_sampling import argmax_triton

    logits = torch.randn(3, 2500, device=DEVICE)
    expected = argmax_triton(logits, 2000)
    assert torch.equal(kernels.argmax(logits, 2000), expected)
    greedy = torch.ones(3, dtype=torch.bool, device=DEVICE)
    assert torch.equal(kernels.gumbel_sample(logits, None, greedy, 7, 2000, chunk=1024), expected)


def test_public_prefill_tile_query_lens_is_the_attention_modules():
    pytest.importorskip("triton")
    from kernels.triton_attention import prefill_tile_query_lens

    for group, float32 in [(1, False), (4, True), (7, False)]:
        expected = prefill_tile_query_lens(group, float32)
        assert kernels.prefill_tile_query_lens(group, float32) == expected


# The interpreter runs one program at a time: llama3-8b's qkv_proj and a long K on GPUs only.
GEMV_SHAPES = [(576, 576), (101, 1000)] + (
    [(6144, 4096), (1536, 8960)] if HAS_CUDA else [(47, 2100)]
)


@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("n,k", GEMV_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@triton_test
def test_triton_gemv_matches_linear(dtype, n, k, bias):
    from kernels.triton_gemv import gemv_triton

    x = torch.randn(1, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    out = gemv_triton(x, w, b)
    assert out.shape == (1, n) and out.dtype == dtype
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert_matches(out, ref.to(dtype))


def test_linear_falls_back_to_torch_off_the_gpu_path():
    # Several rows, float32 or a CPU tensor: plain F.linear.
    w, b = torch.randn(32, 64), torch.randn(32)
    for x in (torch.randn(3, 64), torch.randn(1, 64)):
        assert torch.equal(kernels.linear(x, w, b), F.linear(x, w, b))


@pytest.fixture
def kernel_switch(monkeypatch):
    """set(value): KVRAY_TORCH_KERNELS=value (None: unset), read by kernels; the test's end
    puts back the variable and the switch."""

    def set_switch(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("KVRAY_TORCH_KERNELS", raising=False)
        else:
            monkeypatch.setenv("KVRAY_TORCH_KERNELS", value)
        kernels.read_kernel_switch()

    yield set_switch
    monkeypatch.undo()
    kernels.read_kernel_switch()


@gpu_test
def test_cuda_tensors_dispatch_to_triton_unless_forced_to_references(kernel_switch):
    from kernels.triton_attention import paged_attention_triton

    batch = make_paged_batch([5, 1], [40, 77], 32, 8, 128, 16, torch.bfloat16, "cuda")
    kernel_switch(None)
    assert kernels.use_triton(batch["query"])
    assert torch.equal(kernels.paged_attention(**batch), paged_attention_triton(**batch))
    kernel_switch("1")
    assert not kernels.use_triton(batch["query"])
    assert torch.equal(kernels.paged_attention(**batch), run_ref(batch))
