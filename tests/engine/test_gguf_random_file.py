"""The random GGUF file of tests/support/random_gguf.py (the GPU test's, which needs no
bundled model) loads as a llama of its metadata, and kept quantized on CPU gives the
dequantized model's greedy tokens and logits in float32 (the GPU test's comparison, where
only the K-quants' scales rounded to float16 tell the paths apart: logits to K_QUANT_RTOL
of the largest, as in test_gguf_quantized)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.quantization.woq import WoqLinearMethod
from engine.worker.loader import load_hf_config, resolve_model_source
from tests.support import random_gguf
from tests.support.bundled_checkpoints import greedy_tokens, logits_of
from tests.support.gguf_checkpoints import load_gguf

K_QUANT_RTOL = 2e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = random_gguf.write_random_llama_gguf(tmp_path_factory.mktemp("random-gguf") / "r.gguf")
    config = load_hf_config(resolve_model_source(str(path)))
    quantized = load_gguf(path, "gguf", hf_config=config)
    dequantized = load_gguf(path, "none", hf_config=config)
    return config, quantized, dequantized


def test_the_random_file_loads_as_a_llama_of_its_metadata(models):
    config, quantized, _ = models
    assert (
        config.model_type,
        config.num_hidden_layers,
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.vocab_size,
        config.tie_word_embeddings,
    ) == (
        "llama",
        random_gguf.LAYERS,
        random_gguf.HIDDEN,
        random_gguf.INTERMEDIATE,
        random_gguf.HEADS,
        random_gguf.KV_HEADS,
        random_gguf.HEAD_DIM,
        random_gguf.VOCAB,
        False,
    )
    for layer in quantized.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
            assert isinstance(module.method, WoqLinearMethod)
        assert isinstance(layer.mlp.gate_up_proj.method, WoqLinearMethod)
    # fused layers whose shards differ take the widest: Q4_K q/k with a Q6_K v, a Q4_1 gate
    # with a Q8_0 up, a Q5_K gate with a Q4_K up
    formats = [
        (m.method.bits, m.method.group_size)
        for layer in quantized.model.layers
        for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)
    ]
    assert formats == [(8, 16), (8, 32), (8, 32), (8, 32)]


def test_the_random_file_kept_quantized_gives_the_dequantized_tokens_and_logits(models):
    _, quantized, dequantized = models
    for prompt in random_gguf.PROMPTS:
        tokens = greedy_tokens(dequantized, prompt, random_gguf.NUM_TOKENS)
        ids = prompt + tokens[:-1]
        got, want = logits_of(quantized, ids), logits_of(dequantized, ids)
        atol = K_QUANT_RTOL * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
        assert got[len(prompt) - 1 :].argmax(dim=-1).tolist() == tokens
