"""GGUF tensors repacked into the WOQ layout dequantize to gguf-py's floats.

Q4_0, Q4_1 and Q8_0 match exactly. The K-quants round their sub-block scale and min
products to float16, so a weight may differ by the float16 rounding of its scale and min:
the tolerance per weight is that rounding's bound, 2^-11 * (q * |scale| + |min|) (half an
ulp, relative), widened by 2^-8 of itself for float32 arithmetic, plus (q + 1) * 2^-25 for
a scale or min that is a float16 subnormal (half an ulp, absolute): a few hundredths of a
quantization step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize
from transformers import LlamaConfig

from engine.bundled import bundled_model_path
from engine.layers.quantization.gguf_packing import (
    common_woq_format,
    repack_gguf_tensor,
    widen_woq,
    woq_format,
)
from engine.models.llama import LlamaForCausalLM
from engine.worker.gguf_weights import gguf_tensor_types, iter_gguf_woq_weights, woq_layer_formats
from engine.worker.loader import gguf_to_hf_name, iter_gguf_weights
from tests.support.gguf_quantizers import quantize_gguf

T = GGMLQuantizationType
KEPT = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
EXACT = {T.Q4_0, T.Q4_1, T.Q8_0}
LEVELS = {T.Q4_0: 15, T.Q4_1: 15, T.Q4_K: 15, T.Q5_K: 31, T.Q6_K: 63, T.Q8_0: 255}
# Byte offsets of each type's float16 fields within its block.
HALF_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q8_0: [0],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}


def unpack_q(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 4:
        return torch.stack((qweight & 0x0F, qweight >> 4), dim=-1).flatten(-2)
    return qweight


def woq_dequantize(qweight, scales, mins, bits, group_size) -> torch.Tensor:
    """The WOQ layout's definition (QUANT-SPEC): w = q * scale + min, in float32."""
    q = unpack_q(qweight, bits).float().unflatten(-1, (-1, group_size))
    return (q * scales.float()[..., None] + mins.float()[..., None]).flatten(-2)


def assert_matches_gguf(parts, expected: np.ndarray, exact: bool) -> None:
    got = woq_dequantize(*parts)
    expected = torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32))
    assert got.shape == expected.shape
    if exact:
        assert torch.equal(got, expected)
        return
    q = unpack_q(parts[0], parts[3]).float()
    group = parts[4]
    scale = parts[1].float().abs().repeat_interleave(group, dim=-1)
    offset = parts[2].float().abs().repeat_interleave(group, dim=-1)
    bound = 2.0**-11 * (1 + 2.0**-8) * (q * scale + offset) + (q + 1) * 2.0**-25
    excess = (got - expected).abs() - bound
    assert excess.max() <= 0, f"off by {excess.max().item()} beyond the tolerance"


def random_blocks(qtype, rows: int, num_blocks: int, rng) -> np.ndarray:
    """Random bytes in every bit of the blocks; the float16 factors finite and small."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, num_blocks, type_size), dtype=np.uint8)
    for offset in HALF_FIELDS[qtype]:
        half = rng.uniform(-0.01, 0.01, (rows, num_blocks, 1)).astype(np.float16)
        blocks[..., offset : offset + 2] = half.view(np.uint8)
    return blocks.reshape(rows, num_blocks * type_size)


@pytest.mark.parametrize("qtype", KEPT, ids=lambda t: t.name)
def test_any_block_bytes_repack_to_gguf_py_weights(qtype):
    data = random_blocks(qtype, rows=12, num_blocks=3, rng=np.random.default_rng(int(qtype)))
    parts = repack_gguf_tensor(data, qtype)
    bits, group = woq_format(qtype)
    k = data.shape[1] // GGML_QUANT_SIZES[qtype][1] * GGML_QUANT_SIZES[qtype][0]
    assert (parts.bits, parts.group_size) == (bits, group)
    assert parts.qweight.dtype == torch.uint8 and parts.qweight.shape == (12, k * bits // 8)
    assert parts.scales.dtype == parts.mins.dtype == torch.float16
    assert parts.scales.shape == parts.mins.shape == (12, k // group)
    assert_matches_gguf(parts, dequantize(data, qtype), exact=qtype in EXACT)


@pytest.mark.parametrize("qtype", KEPT, ids=lambda t: t.name)
def test_quantized_weights_repack_to_gguf_py_weights(qtype):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 512)).astype(np.float32) * 0.02
    w[:8, :64] += 0.05  # groups lying off zero: nonzero mins for the K-quants
    data = quantize_gguf(w, qtype)
    expected = dequantize(data, qtype)
    # The reference quantizer is sound: off by less than a step of the whole tensor's range.
    assert np.abs(expected - w).max() < (w.max() - w.min()) / LEVELS[qtype]
    assert_matches_gguf(repack_gguf_tensor(data, qtype), expected, exact=qtype in EXACT)


def test_formats_of_gguf_types():
    assert woq_format(T.Q4_K) == (4, 32) and woq_format(T.Q5_K) == (8, 32)
    assert woq_format(T.Q6_K) == (8, 16) and woq_format(int(T.Q8_0)) == (8, 32)
    for float_or_dequantized in (T.F32, T.F16, T.BF16, T.Q5_0, T.Q2_K, T.IQ4_NL):
        assert woq_format(float_or_dequantized) is None


def test_bad_tensors_are_named():
    with pytest.raises(ValueError, match="tensor_type Q5_0"):
        repack_gguf_tensor(np.zeros((2, 22), np.uint8), T.Q5_0)
    with pytest.raises(ValueError, match="data must be uint8"):
        repack_gguf_tensor(np.zeros((2, 17), np.uint8), T.Q4_0)
    with pytest.raises(ValueError, match="data must be uint8"):
        repack_gguf_tensor(np.zeros(36, np.uint8), T.Q4_0)
    huge = np.zeros((1, 210), np.uint8)
    huge[0, 192:208] = 127  # sub-block scales 127 of d = 60000
    huge[0, 208:210] = np.array([60000], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="scales of a Q6_K tensor exceed the float16 range"):
        repack_gguf_tensor(huge, T.Q6_K)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q4_0, T.Q8_0], ids=lambda t: t.name)
def test_widened_weights_are_the_same_weights(qtype):
    data = random_blocks(qtype, rows=4, num_blocks=2, rng=np.random.default_rng(2))
    parts = repack_gguf_tensor(data, qtype)
    widened = widen_woq(*parts, to_bits=8, to_group=16)
    assert widened[0].shape == (4, parts.qweight.shape[1] * 8 // parts.bits)
    assert widened[1].shape[1] == parts.scales.shape[1] * parts.group_size // 16
    assert torch.equal(woq_dequantize(*widened, 8, 16), woq_dequantize(*parts))


def test_widening_only_widens():
    parts = repack_gguf_tensor(random_blocks(T.Q8_0, 2, 1, np.random.default_rng(3)), T.Q8_0)
    with pytest.raises(ValueError, match="to_bits"):
        widen_woq(*parts, to_bits=4, to_group=32)
    with pytest.raises(ValueError, match="to_group"):
        widen_woq(*parts, to_bits=8, to_group=64)
    with pytest.raises(ValueError, match="to_group"):
        widen_woq(*parts, to_bits=8, to_group=24)


def test_a_fused_layer_takes_the_widest_bits_and_smallest_group():
    assert common_woq_format([(4, 32), (4, 32), (8, 16)]) == (8, 16)
    assert common_woq_format([(4, 32), (8, 32)]) == (8, 32)
    assert common_woq_format([(4, 32), None]) is None


def test_bundled_gguf_linear_weights_repack_to_its_floats():
    """Every quantized linear tensor of the bundled file (all Q4_1) repacks to exactly the
    weights gguf-py dequantizes (one reader: opening the file is most of the time)."""
    reader = GGUFReader(bundled_model_path())
    types = gguf_tensor_types(reader)
    assert len(types) == 30 * 7 and set(types.values()) == {(4, 32)}
    for tensor in reader.tensors:
        prefix = gguf_to_hf_name(tensor.name).removesuffix(".weight")
        if prefix in types:
            parts = repack_gguf_tensor(tensor.data, tensor.tensor_type)
            expected = dequantize(tensor.data, tensor.tensor_type)
            assert_matches_gguf(parts, expected, exact=True)


TINY = LlamaConfig(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
)
# A mixed file: q/k Q4_K beside a Q6_K v (as Q4_K_M), gate Q4_0 beside an up of a type not
# kept quantized (Q5_0), and a Q4_K embedding and head, which load as float.
MIXED_TYPES = {
    "token_embd": T.Q4_K,
    "output": T.Q4_K,
    "blk.0.attn_q": T.Q4_K,
    "blk.0.attn_k": T.Q4_K,
    "blk.0.attn_v": T.Q6_K,
    "blk.0.attn_output": T.Q5_K,
    "blk.0.ffn_gate": T.Q4_0,
    "blk.0.ffn_up": T.Q5_0,
    "blk.0.ffn_down": T.Q8_0,
}
SHAPES = {
    "token_embd": (64, 256),
    "output": (64, 256),
    "blk.0.attn_q": (256, 256),
    "blk.0.attn_k": (128, 256),
    "blk.0.attn_v": (128, 256),
    "blk.0.attn_output": (256, 256),
    "blk.0.ffn_gate": (512, 256),
    "blk.0.ffn_up": (512, 256),
    "blk.0.ffn_down": (256, 512),
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "mixed.gguf"
    rng = np.random.default_rng(4)
    writer = GGUFWriter(path, "llama")
    for name, qtype in MIXED_TYPES.items():
        w = rng.standard_normal(SHAPES[name]).astype(np.float32) * 0.02
        writer.add_tensor(f"{name}.weight", quantize_gguf(w, qtype), raw_dtype=qtype)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(256, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_mixed_gguf_fused_layers_share_one_format(mixed_gguf):
    types = gguf_tensor_types(mixed_gguf)
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert types == {
        f"{attn}.q_proj": (4, 32),
        f"{attn}.k_proj": (4, 32),
        f"{attn}.v_proj": (8, 16),
        f"{attn}.o_proj": (8, 32),
        f"{mlp}.gate_proj": (4, 32),
        f"{mlp}.down_proj": (8, 32),
    }
    formats = woq_layer_formats(types, LlamaForCausalLM.packed_modules_mapping)
    assert formats == {
        f"{attn}.q_proj": (8, 16),
        f"{attn}.k_proj": (8, 16),
        f"{attn}.v_proj": (8, 16),
        f"{attn}.qkv_proj": (8, 16),
        f"{attn}.o_proj": (8, 32),
        f"{mlp}.down_proj": (8, 32),
    }

    expected = dict(iter_gguf_weights(mixed_gguf, TINY))
    got = dict(iter_gguf_woq_weights(mixed_gguf, TINY, formats))
    float_names = {"model.embed_tokens.weight", "lm_head.weight", f"{mlp}.gate_proj.weight"}
    float_names |= {f"{mlp}.up_proj.weight", "model.layers.0.input_layernorm.weight"}
    assert {
        n for n, t in got.items() if t.is_floating_point() and n.endswith("weight")
    } == float_names
    for name in float_names:
        assert torch.equal(got[name], expected[name])
    for prefix, (bits, group) in formats.items():
        if prefix.endswith("qkv_proj"):
            continue
        parts = [got[f"{prefix}.{p}"] for p in ("qweight", "scales", "mins")]
        qtype = {gguf_to_hf_name(f"{n}.weight"): t for n, t in MIXED_TYPES.items()}[
            f"{prefix}.weight"
        ]
        assert_matches_gguf((*parts, bits, group), expected[f"{prefix}.weight"], qtype in EXACT)


def test_a_layer_stored_narrower_than_its_type_is_named(mixed_gguf):
    formats = {"model.layers.0.self_attn.v_proj": (4, 32)}
    with pytest.raises(ValueError, match=r"v_proj.weight \(Q6_K\): to_bits"):
        list(iter_gguf_woq_weights(mixed_gguf, TINY, formats))
    formats = {"model.layers.0.mlp.up_proj": (8, 32)}
    with pytest.raises(ValueError, match="up_proj.weight is Q5_0, which is not kept quantized"):
        list(iter_gguf_woq_weights(mixed_gguf, TINY, formats))
