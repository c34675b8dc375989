"""Named model shapes for dummy-weight runs: the real configs, no checkpoint needed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama3(**kw: Any) -> PretrainedConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_parameters=dict(_LLAMA3_ROPE),
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        dtype="bfloat16",
        **kw,
    )


_SHAPES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama3-8b": lambda: _llama3(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32
    ),
    "llama3-70b": lambda: _llama3(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64
    ),
    "qwen3-0.6b": lambda: Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        dtype="bfloat16",
    ),
    "qwen2.5-7b": lambda: Qwen2Config(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        dtype="bfloat16",
    ),
    "smollm2-135m": lambda: LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    ),
    # Tests: a few MB, GQA, and the bundled tokenizer's vocabulary so the two can be paired.
    "tiny-llama": lambda: LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    ),
}

SHAPE_NAMES = tuple(_SHAPES)


def get_shape_config(name: str) -> PretrainedConfig:
    """A fresh HF config for a named shape; ValueError listing the known names."""
    if name not in _SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPE_NAMES)}")
    return _SHAPES[name]()
