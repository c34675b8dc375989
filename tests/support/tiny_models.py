"""Small random checkpoints written on the fly, for tests that need real weights files."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

# Engine arguments that fit the tiny Llama: a short context and a small block pool.
TINY_ARGS = dict(max_model_len=128, num_gpu_blocks=64, block_size=4)


def write_tiny_llama(folder) -> str:
    """A random 4-layer Llama (4 query and 4 KV heads) saved as safetensors, no tokenizer."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder)
    return str(folder)
