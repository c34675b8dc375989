"""GGUF files kept quantized (quantization="gguf": WOQ layers, kernels.woq_linear) give the
logits and greedy tokens of the same files dequantized at load (quantization="none", the
float path that test_loader proves equal to transformers), whole or cut between two
tensor-parallel ranks.

Tolerances. Q4_0, Q4_1 and Q8_0 repack exactly: the layers multiply the very weights the
float path holds, so the logits agree to float32 rounding (EXACT_ATOL). The K-quants round
each sub-block's scale and min (a float16 super-block factor times a 6- or 8-bit one) to
float16, moving each weight by up to 2^-11 of its scale and min terms (test_gguf_packing
bounds it); their logits are held to K_QUANT_RTOL of the largest, a few times what that
rounding moves them by through the layers.

The other files are written from the bundled file's weights (dequantized by gguf-py), cut
to a shape the K-quants can store: their 256-value blocks need a multiple of 256 inputs,
and SmolLM2's hidden size is 576. The cut keeps hidden features 0-511, q heads 0-7 and kv
heads 0-1 (of 64 features: two tensor-parallel ranks can split them) and the first
CUT_LAYERS layers.
Greedy tokens: the dequantized model's, one whole-prompt forward per token; the quantized
model must pick each of them from one forward over the prompt and the tokens before it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from engine.bundled import bundled_model_path
from engine.distributed import override_parallel_state
from engine.layers.linear import RowParallelLinear
from engine.layers.quantization.base import UNQUANTIZED
from engine.layers.quantization.gguf import GgufConfig
from engine.layers.quantization.woq import WoqLinearMethod
from engine.models.registry import architectures_of, get_model_class
from engine.worker.loader import load_hf_config, resolve_model_source
from tests.support.bundled_checkpoints import (
    PROMPT,
    bundled_float_weights,
    greedy_tokens,
    logits_of,
)
from tests.support.gguf_checkpoints import load_gguf, read_gguf_floats, write_gguf

T = GGMLQuantizationType
EXACT_ATOL = 1e-4
K_QUANT_RTOL = 2e-3
NUM_TOKENS = 4
CUT_LAYERS = 2
HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 512, 64, 8, 2
CUT_FIELDS = {
    "llama.block_count": CUT_LAYERS,
    "llama.embedding_length": HIDDEN,
    "llama.attention.head_count": HEADS,
    "llama.attention.head_count_kv": KV_HEADS,
}
# Layer 0 holds every kept type, q/k widened to v's 8 bits and group 16 and gate to up's
# 8 bits; layer 1's gate is Q5_0, which the kernels do not run: its gate_up stays float.
MIXED = {
    "blk.0.attn_q": T.Q4_K,
    "blk.0.attn_k": T.Q4_K,
    "blk.0.attn_v": T.Q6_K,
    "blk.0.attn_output": T.Q4_0,
    "blk.0.ffn_gate": T.Q4_1,
    "blk.0.ffn_up": T.Q8_0,
    "blk.0.ffn_down": T.Q5_K,
    "blk.1.ffn_gate": T.Q5_0,
}
LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
FILES = ["Q4_K", "Q6_K", "Q8_0", "mixed"]


def _cut(name: str, w: np.ndarray) -> np.ndarray:
    """A tensor of the bundled file cut to the HIDDEN features, HEADS and KV_HEADS (rows of
    a head stay together in llama.cpp's order of q and k)."""
    module = name.split(".")[-2]
    if module == "attn_q":
        return w[: HEADS * HEAD_DIM, :HIDDEN]
    if module in ("attn_k", "attn_v"):
        return w[: KV_HEADS * HEAD_DIM, :HIDDEN]
    if module == "attn_output":
        return w[:HIDDEN, : HEADS * HEAD_DIM]
    if module in ("ffn_gate", "ffn_up", "token_embd"):
        return w[:, :HIDDEN]
    return w[:HIDDEN]  # ffn_down, norms


def _in_cut(name: str) -> bool:
    return not name.startswith("blk.") or int(name.split(".")[1]) < CUT_LAYERS


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """{file: path} of the cut model with its linear layers in one type or MIXED (Q8_0
    where MIXED names none), an F16 embedding and F32 norms."""
    metadata, tensors = read_gguf_floats(bundled_model_path(), _in_cut)
    tensors = {name: _cut(name, w) for name, w in tensors.items()}
    folder = tmp_path_factory.mktemp("gguf-quantized")
    files = {}
    for file in FILES:
        types = {"token_embd.weight": T.F16}
        for name in tensors:
            if name.split(".")[-2] in LINEAR:
                mixed = MIXED.get(name.removesuffix(".weight"), T.Q8_0)
                types[name] = mixed if file == "mixed" else T[file]
        path = folder / f"cut-{file}.gguf"
        files[file] = write_gguf(path, tensors, types, metadata, CUT_FIELDS)
    return files


def _assert_same_logits_and_tokens(quantized, dequantized, rtol: float | None, tokens=None):
    """Logits of PROMPT within the tolerance (rtol of the largest; None: EXACT_ATOL), and
    the dequantized model's NUM_TOKENS greedy tokens (`tokens` if known) chosen by the
    quantized one."""
    tokens = tokens or greedy_tokens(dequantized, PROMPT, NUM_TOKENS)
    ids = PROMPT + tokens[:-1]
    got, want = logits_of(quantized, ids), logits_of(dequantized, ids)
    atol = EXACT_ATOL if rtol is None else rtol * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    assert got[len(PROMPT) - 1 :].argmax(dim=-1).tolist() == tokens


def _methods(model) -> dict[str, object]:
    layers = {}
    for i, layer in enumerate(model.model.layers):
        for name, module in (*layer.self_attn.named_children(), *layer.mlp.named_children()):
            if name.endswith("proj"):
                layers[f"{i}.{name}"] = module.method
    return layers


@pytest.fixture(scope="module")
def bundled_reference():
    """(config, the bundled model as quantization="none" loads it, its greedy tokens)."""
    config, tensors = bundled_float_weights()
    model = get_model_class(architectures_of(config))(config)
    model.load_weights(tensors.items())
    return config, model.eval(), greedy_tokens(model, PROMPT, NUM_TOKENS)


def test_the_bundled_q4_1_file_kept_quantized_gives_the_dequantized_logits(bundled_reference):
    """The bundled SmolLM2 (Q4_1 layers) loaded as the engine loads it, against its float
    weights (bundled_float_weights: what quantization="none" loads)."""
    config, dequantized, tokens = bundled_reference
    quantized = load_gguf(bundled_model_path(), "gguf", hf_config=config)
    assert {type(m) for m in _methods(quantized).values()} == {WoqLinearMethod}
    _assert_same_logits_and_tokens(quantized, dequantized, None, tokens)


@pytest.mark.parametrize("file", FILES)
def test_k_quant_and_mixed_files_kept_quantized_give_the_dequantized_logits(gguf_files, file):
    quantized = load_gguf(gguf_files[file], "gguf")
    dequantized = load_gguf(gguf_files[file], "none")
    assert not any(m.quantized for m in dequantized.modules() if hasattr(m, "quantized"))
    rtol = None if file == "Q8_0" else K_QUANT_RTOL
    _assert_same_logits_and_tokens(quantized, dequantized, rtol)


def test_each_layer_of_a_mixed_file_takes_its_shards_common_format(gguf_files, monkeypatch):
    opened = []

    class CountingReader(GGUFReader):
        def __init__(self, *args, **kwargs):
            opened.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr("gguf.GGUFReader", CountingReader)
    path = gguf_files["mixed"]
    config = load_hf_config(resolve_model_source(str(path)))  # transformers parses it too
    opened.clear()
    model = load_gguf(path, "gguf", hf_config=config)
    assert len(opened) == 1, "the file was parsed more than once"
    formats = {
        name: (m.bits, m.group_size) if m is not UNQUANTIZED else None
        for name, m in _methods(model).items()
    }
    assert formats == {
        "0.qkv_proj": (8, 16),  # Q4_K q and k widened to the Q6_K v
        "0.o_proj": (4, 32),
        "0.gate_up_proj": (8, 32),  # Q4_1 gate widened to the Q8_0 up
        "0.down_proj": (8, 32),
        "1.qkv_proj": (8, 32),
        "1.o_proj": (8, 32),
        "1.gate_up_proj": None,  # a Q5_0 gate: dequantized, with its up
        "1.down_proj": (8, 32),
    }
    assert model.model.layers[1].mlp.gate_up_proj.weight.dtype == torch.float32


@pytest.fixture(scope="module")
def tensor_parallel_models(gguf_files):
    path = gguf_files["mixed"]
    whole = load_gguf(path, "gguf")
    return whole, [load_gguf(path, "gguf", tp_rank=r, tp_size=2) for r in range(2)]


@pytest.mark.parametrize("layer", ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"])
def test_two_tensor_parallel_ranks_reproduce_each_quantized_layer(tensor_parallel_models, layer):
    whole, ranks = tensor_parallel_models
    block = "self_attn" if layer in ("qkv_proj", "o_proj") else "mlp"

    def module_of(model):
        module = getattr(getattr(model.model.layers[0], block), layer)
        assert isinstance(module.method, WoqLinearMethod)
        return module

    full, parts = module_of(whole), [module_of(m) for m in ranks]
    x = torch.randn(3, full.input_size, generator=torch.Generator().manual_seed(0))
    want = full.method.apply(full, x)
    if layer in ("o_proj", "down_proj"):  # row parallel: each rank's inputs, summed
        xs = x.chunk(2, dim=1)
        got = sum(p.method.apply(p, x_r) for p, x_r in zip(parts, xs, strict=True))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    # column parallel: rank r holds its part of each shard ([q_r | k_r | v_r]); put the
    # shards' parts back in order
    outs = [p.method.apply(p, x) for p in parts]
    kv = KV_HEADS * HEAD_DIM
    sizes = [HEADS * HEAD_DIM, kv, kv] if layer == "qkv_proj" else [full.output_size // 2] * 2
    split = [[s // 2 for s in sizes] for _ in parts]
    pieces = [out.split(s, dim=1) for out, s in zip(outs, split, strict=True)]
    got = torch.cat([piece for shard in zip(*pieces, strict=True) for piece in shard], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_rank_whose_inputs_split_a_group_is_refused_naming_the_layer():
    method = GgufConfig("x.gguf", {"m.down_proj": (4, 32)}).linear_method(
        "m.down_proj", ["m.down_proj"]
    )
    with (
        override_parallel_state(tp_rank=0, tp_size=2),
        pytest.raises(
            ValueError, match=r"m\.down_proj\.scales: this rank's 48 .* gguf groups of 32"
        ),
    ):
        RowParallelLinear(96, 64, method=method, prefix="m.down_proj")


def test_llm_serves_the_bundled_gguf_kept_quantized(bundled_reference):
    from engine import LLM, SamplingParams

    llm = LLM(model=str(bundled_model_path()), quantization="gguf", max_model_len=64)
    try:
        assert llm.engine.config.model.quantization == "gguf"
        model = llm.engine.executor.worker.runner.model
        assert isinstance(model.model.layers[0].self_attn.qkv_proj.method, WoqLinearMethod)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        out = llm.generate(PROMPT, params)[0].outputs[0]
        assert list(out.token_ids) == bundled_reference[2][:2]
    finally:
        llm.engine.shutdown()
