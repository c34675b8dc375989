"""GGUF weights with the linear layers kept quantized (WOQ layout) instead of dequantized.

The bits and group size of each layer travel in a side table, not in the tensor stream: the
quantization config needs them before the model exists (a layer's `qweight` and `scales`
shapes depend on them), so it is built from the file first:

    types = gguf_tensor_types(path)          # {layer prefix: (bits, group)} per GGUF tensor
    formats = woq_layer_formats(types, model_cls.packed_modules_mapping)
    weights = iter_gguf_woq_weights(path, hf_config, formats)

`formats` holds the format every kept layer is stored at, fused layers ("...qkv_proj")
included: the shards of a fused layer are widened to the most bits and smallest group among
them (`common_woq_format`, `widen_woq`), e.g. Q4_K q/k beside a Q6_K v are all stored at 8
bits, group 16; a fused layer with any shard of a type not kept quantized stays float.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.layers.quantization.gguf_packing import (
    common_woq_format,
    repack_gguf_tensor,
    widen_woq,
    woq_format,
)
from engine.worker.loader import _unpermute_rope_rows, gguf_to_hf_name

if TYPE_CHECKING:
    from gguf import GGUFReader

LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The checkpoint layers whose weights may stay quantized (never embeddings or the LM head)."""

WOQ_PARTS = ("qweight", "scales", "mins")
"""The tensors a kept layer's weight becomes, as `{prefix}.{part}`."""


def _linear_prefix(hf_name: str) -> str | None:
    """'model.layers.0.self_attn.q_proj.weight' -> 'model.layers.0.self_attn.q_proj'; None
    for any other tensor (biases, norms, embeddings, the LM head)."""
    prefix, _, param = hf_name.rpartition(".")
    if param != "weight" or not prefix.startswith("model.layers."):
        return None
    return prefix if prefix.rpartition(".")[2] in LINEAR_LAYERS else None


def open_gguf(path: str | Path | GGUFReader) -> GGUFReader:
    """A reader of the file; an open reader as it is (parsing a file's header takes a while,
    so callers that read one file twice may open it once)."""
    from gguf import GGUFReader

    return path if isinstance(path, GGUFReader) else GGUFReader(path)


def gguf_tensor_types(path: str | Path | GGUFReader) -> dict[str, tuple[int, int]]:
    """{HF layer prefix ('model.layers.3.self_attn.q_proj'): (bits, group_size)} of the
    linear-layer weights of a GGUF file (or open reader) whose type is kept quantized;
    layers of other types are absent (they load as float). Reads no tensor data."""
    types = {}
    for tensor in open_gguf(path).tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        prefix = None if hf_name is None else _linear_prefix(hf_name)
        fmt = woq_format(tensor.tensor_type)
        if prefix is not None and fmt is not None:
            types[prefix] = fmt
    return types


def woq_layer_formats(
    tensor_types: Mapping[str, tuple[int, int]],
    packed_modules_mapping: Mapping[str, list[str]],
) -> dict[str, tuple[int, int]]:
    """The (bits, group_size) each layer is stored at: a layer's own format, or for the
    shards of a fused layer (packed_modules_mapping: {"qkv_proj": ["q_proj", "k_proj",
    "v_proj"], ...}) their common one, under the shard prefixes and the fused prefix. Shards
    of a fused layer any of whose shards is not in tensor_types are left out (float)."""
    shard_of = {s: fused for fused, shards in packed_modules_mapping.items() for s in shards}
    formats = {}
    for prefix, fmt in tensor_types.items():
        parent, _, module = prefix.rpartition(".")
        fused = shard_of.get(module)
        if fused is None:
            formats[prefix] = fmt
            continue
        shards = packed_modules_mapping[fused]
        common = common_woq_format(tensor_types.get(f"{parent}.{s}") for s in shards)
        if common is not None:
            formats[prefix] = formats[f"{parent}.{fused}"] = common
    return formats


def iter_gguf_woq_weights(
    path: str | Path | GGUFReader, hf_config: Any, formats: Mapping[str, tuple[int, int]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A GGUF file's (or open reader's) tensors under HF names, one at a time: for each linear layer in
    `formats` its weight as `{prefix}.qweight` (uint8), `.scales` and `.mins` (float16) at
    that layer's (bits, group_size); every other tensor dequantized to float32 as
    `iter_gguf_weights` yields it."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads

    def rope_heads(hf_name: str) -> int | None:
        """Heads whose rows llama.cpp permuted for its interleaved rope (llama only)."""
        if arch != "llama":
            return None
        module = hf_name.rsplit(".", 2)[-2]
        return {"q_proj": num_heads, "k_proj": num_kv_heads}.get(module)

    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        heads = rope_heads(hf_name)
        prefix = _linear_prefix(hf_name)
        if prefix is not None and prefix in formats:
            parts = _stored_woq(tensor, hf_name, formats[prefix])
            for part, value in zip(WOQ_PARTS, parts):
                yield f"{prefix}.{part}", _unpermute_rope_rows(value, heads) if heads else value
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        if heads:
            weights = _unpermute_rope_rows(weights, heads)
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        if not weights.flags.writeable:  # unquantized tensors are views of the read-only mmap
            weights = weights.copy()
        yield hf_name, torch.from_numpy(weights)


def _stored_woq(tensor: Any, hf_name: str, fmt: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """A GGUF tensor repacked and widened to the (bits, group_size) `fmt`."""
    if woq_format(tensor.tensor_type) is None:
        raise ValueError(
            f"{hf_name} is {tensor.tensor_type.name}, which is not kept quantized, but its "
            f"layer is stored at (bits, group_size)={fmt}"
        )
    parts = repack_gguf_tensor(tensor.data, tensor.tensor_type)
    try:
        return widen_woq(*parts, *fmt)
    except ValueError as e:
        raise ValueError(f"{hf_name} ({tensor.tensor_type.name}): {e}") from None
