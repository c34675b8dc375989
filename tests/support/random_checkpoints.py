"""A small random Llama written as HF folders: its float weights and quantized checkpoints of
them (FP8, AWQ), for tests that cannot use the bundled model (the GPU machine has no copy).

Sizes fit every format's kernels: inputs are multiples of 128 (AWQ groups of 128, FP8 block
and tensor-core steps), 4 heads of 64 and 2 KV heads (two tensor-parallel ranks would split).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

CONFIG = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    architectures=["LlamaForCausalLM"],
)


def random_llama_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named float32 weights of std 0.02 with 1 % at std 0.2, norms at 1, and an LM head
    ten times larger, so that next-token choices are not near-ties."""
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).state_dict()
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, meta in shapes.items():
        if "norm" in name:
            weights[name] = torch.ones(meta.shape)
            continue
        w = torch.randn(meta.shape, generator=gen) * 0.02
        big = torch.rand(meta.shape, generator=gen) < 0.01
        w[big] *= 10
        weights[name] = w * 10 if name == "lm_head.weight" else w
    return weights


def write_llama(folder: Path, tensors: dict[str, torch.Tensor], quantization_config=None) -> str:
    """An HF folder of the random Llama's config (with `quantization_config`) and tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    fields = LlamaConfig(**CONFIG).to_dict() | {"torch_dtype": "float32"}
    if quantization_config is not None:
        fields["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(fields))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    return str(folder)


PROMPTS = [
    [11, 87, 203, 45, 310, 9, 77, 150],
    [400, 3, 58, 121, 266, 19, 480, 7],
    [250, 251, 33, 90, 144, 312, 5, 61],
]
"""Token-id prompts: prefilled together, 24 tokens."""
