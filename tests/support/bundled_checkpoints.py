"""Checkpoints written from the bundled model's weights, and a small greedy runner.

Each quantized format is checked the same way: a reference quantizer (tests/support) turns
the bundled SmolLM2's float weights into that format's checkpoint tensors, kvray loads the
checkpoint, and its logits and greedy tokens are compared with a float model built from the
same weights dequantized.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.distributed import override_parallel_state
from engine.forward_context import AttentionMetadata, forward_context
from engine.layers.attention import attention_layers, bind_kv_caches
from engine.layers.quantization import build_quant_config, resolve_quantization
from engine.worker.loader import load_hf_config, load_model, resolve_model_source

CPU = torch.device("cpu")
LINEAR_SUFFIXES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)
"""The checkpoint tensors that quantized formats store quantized (embeddings, norms and the
LM head stay float)."""


@functools.cache
def bundled_float_weights() -> tuple[object, dict[str, torch.Tensor]]:
    """(HF config, HF-named float32 tensors) of the bundled model, dequantized from its GGUF."""
    from engine.worker.loader import iter_gguf_weights

    source = resolve_model_source(None)
    config = load_hf_config(source)
    tensors = dict(iter_gguf_weights(Path(source.path), config))
    return config, tensors


def is_quantized_linear(name: str) -> bool:
    return name.endswith(LINEAR_SUFFIXES)


def write_checkpoint(
    folder: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None = None
) -> Path:
    """An HF folder (config.json + model.safetensors) of the bundled model's config."""
    config, _ = bundled_float_weights()
    folder.mkdir(parents=True, exist_ok=True)
    fields = config.to_dict()
    fields["architectures"] = ["LlamaForCausalLM"]
    fields["torch_dtype"] = "float32"
    if quantization_config is not None:
        fields["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(fields))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    return folder


def load_checkpoint(
    folder: Path | str,
    quantization: str = "auto",
    dtype: torch.dtype = torch.float32,
    tp_rank: int = 0,
    tp_size: int = 1,
):
    """kvray's model of a checkpoint on CPU (one tensor-parallel rank's shard with tp_size)."""
    source = resolve_model_source(str(folder))
    config = load_hf_config(source)
    method = resolve_quantization(quantization, config, str(folder), "auto", "cpu")
    quant_config = build_quant_config(method, config, str(folder), CPU)
    with override_parallel_state(tp_rank=tp_rank, tp_size=tp_size):
        return load_model(source, config, dtype, CPU, quant_config=quant_config)


def logits_of(model, ids: list[int]) -> torch.Tensor:
    """One whole-prompt forward without a KV cache: float32 logits [len(ids), vocab]."""
    bind_kv_caches(model, [None] * len(attention_layers(model)))
    n = len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.long),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
    )
    with torch.no_grad(), forward_context(meta):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n)))


def greedy_tokens(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids`, each step a whole-prompt forward (no KV cache)."""
    ids = list(ids)
    out = []
    for _ in range(n):
        out.append(int(logits_of(model, ids)[-1].argmax()))
        ids.append(out[-1])
    return out


PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 7158, 314]
"""The bundled tokenizer's ids of "The capital of France is Paris. The capital of Italy is"."""


def assert_ranks_hold_layers(folder: Path | str, layer: int = 1) -> None:
    """Three tensor-parallel ranks of a checkpoint of the bundled model (its 9 heads and 3
    KV heads do not split in two) hold one layer between them: their qkv outputs put back
    in head order, and their down_proj partial sums added, are the whole layer's."""
    whole = load_checkpoint(folder).model.layers[layer]
    ranks = [load_checkpoint(folder, tp_rank=r, tp_size=3).model.layers[layer] for r in range(3)]
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # column-parallel: rank r holds [q_r | k_r | v_r] (3 q heads, 1 k, 1 v of 64)
        parts = [rank.self_attn.qkv_proj(x) for rank in ranks]
        q, k, v = (
            torch.cat([p[:, a:b] for p in parts], 1) for a, b in ((0, 192), (192, 256), (256, 320))
        )
        torch.testing.assert_close(torch.cat([q, k, v], 1), whole.self_attn.qkv_proj(x))
        # row-parallel: each rank multiplies its third of the inputs
        h = torch.randn(3, 1536, generator=torch.Generator().manual_seed(1))
        down = [
            rank.mlp.down_proj.method.apply(rank.mlp.down_proj, part)
            for rank, part in zip(ranks, h.chunk(3, dim=1), strict=True)
        ]
        torch.testing.assert_close(sum(down), whole.mlp.down_proj(h), atol=1e-4, rtol=0)
