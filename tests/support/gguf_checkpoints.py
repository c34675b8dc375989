"""GGUF files written from another file's float weights, and kvray's model of one (a
tensor-parallel rank's).

The GGUF counterpart of bundled_checkpoints' write_checkpoint / load_checkpoint. Tensors
keep llama.cpp's names and row order (q and k rows interleaved for its rope), so a file's
weights, read by `read_gguf_floats` and changed as a test likes, are written back by
`write_gguf` in other types (the reference quantizers of tests/support/gguf_quantizers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from engine.distributed import override_parallel_state
from engine.layers.quantization import build_quant_config, resolve_quantization
from engine.worker.loader import load_hf_config, load_model, resolve_model_source
from tests.support.gguf_quantizers import quantize_gguf

CPU = torch.device("cpu")
Metadata = Sequence[tuple[str, Any, GGUFValueType, GGUFValueType | None]]


def read_gguf_floats(
    path: Path | str, keep: Callable[[str], bool] = lambda name: True
) -> tuple[Metadata, dict[str, np.ndarray]]:
    """(metadata, {GGUF name: float32 tensor}) of the tensors `keep` accepts, one parse of
    the file. metadata: its key-value fields as (key, value, type, array item type), less
    the reader's own header fields, the architecture (GGUFWriter adds it) and the tokenizer
    (the files written here are fed token ids; its vocabulary is most of a parse's time)."""
    reader = GGUFReader(path)
    metadata = []
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        metadata.append((key, field.contents(), field.types[0], sub_type))
    tensors = {
        t.name: np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        for t in reader.tensors
        if keep(t.name)
    }
    return metadata, tensors


def write_gguf(
    path: Path,
    tensors: Mapping[str, np.ndarray],
    types: Mapping[str, GGMLQuantizationType],
    metadata: Metadata,
    overrides: Mapping[str, Any] | None = None,
) -> Path:
    """A llama GGUF file of GGUF-named float tensors, each stored at types[name] (F32 where
    types has none); `metadata` as read_gguf_floats gives it, with the values of the keys
    in `overrides` replaced ({"llama.block_count": 2})."""
    overrides = dict(overrides or {})
    missing = set(overrides) - {key for key, _, _, _ in metadata}
    if missing:
        raise ValueError(f"overrides name keys the metadata lacks: {sorted(missing)}")
    writer = GGUFWriter(path, "llama")
    for key, value, vtype, sub_type in metadata:
        writer.add_key_value(key, overrides.get(key, value), vtype, sub_type=sub_type)
    for name, w in tensors.items():
        qtype = types.get(name, GGMLQuantizationType.F32)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float16))
        else:
            writer.add_tensor(name, quantize_gguf(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_gguf(
    path: Path | str,
    quantization: str = "gguf",
    dtype: torch.dtype = torch.float32,
    tp_rank: int = 0,
    tp_size: int = 1,
    hf_config: Any = None,
):
    """kvray's model of a GGUF file on CPU, loaded as the engine loads it: quantization
    "gguf" keeps its layers quantized, "none" dequantizes them (one tensor-parallel rank's
    shard with tp_size). hf_config: the file's config where the caller has it (reading it
    parses the file)."""
    source = resolve_model_source(str(path))
    config = hf_config if hf_config is not None else load_hf_config(source)
    method = resolve_quantization(quantization, config, str(path), "auto", "cpu")
    with override_parallel_state(tp_rank=tp_rank, tp_size=tp_size):
        quant_config = build_quant_config(method, config, source.path, CPU)
        return load_model(source, config, dtype, CPU, quant_config=quant_config)
