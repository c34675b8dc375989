"""GGUF files kept quantized: each linear layer of a type the WOQ kernels run (Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K, Q6_K) is stored in the WOQ layout at its type's bits and group size.

The format of every layer is read from the file's tensor table before the model is built
(a layer's parameter shapes depend on it): a fused layer (q/k/v, gate/up) takes the most
bits and smallest group of its shards, widening the others exactly. Layers of any other
type (F16, Q5_0, Q2_K, IQ...) load as floats, dequantized, and so do the embeddings and the
LM head. Opening a GGUF file parses its whole header (the tokenizer's vocabulary with it),
so the reader opened to read the types is kept for the one pass over the tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from engine.layers.quantization.base import UNQUANTIZED, LinearMethod, QuantConfig
from engine.layers.quantization.gguf_packing import common_woq_format
from engine.layers.quantization.woq import WoqLinearMethod
from engine.worker.gguf_weights import (
    gguf_tensor_types,
    iter_gguf_woq_weights,
    open_gguf,
    woq_layer_formats,
)


class GgufConfig(QuantConfig):
    """The layers of one GGUF file: `formats` {layer prefix: (bits, group_size)} of those
    kept quantized, fused layers under their own and their shards' prefixes."""

    name = "gguf"

    def __init__(self, path: str | Path, formats: Mapping[str, tuple[int, int]], reader=None):
        self.path = Path(path)
        self.formats = dict(formats)
        self._reader = reader  # handed to the first gguf_weights of this file, then dropped
        self._methods: dict[tuple[int, int], WoqLinearMethod] = {}

    @classmethod
    def create(cls, hf_config, model: str | None, device: torch.device) -> GgufConfig:
        from engine.bundled import bundled_model_path
        from engine.models.registry import architectures_of, get_model_class

        path = bundled_model_path() if model is None else Path(model)
        model_cls = get_model_class(architectures_of(hf_config))
        packed = getattr(model_cls, "packed_modules_mapping", {})
        reader = open_gguf(path)
        return cls(path, woq_layer_formats(gguf_tensor_types(reader), packed), reader)

    def linear_method(self, prefix: str, shards: list[str]) -> LinearMethod:
        fmt = common_woq_format(self.formats.get(shard) for shard in shards)
        if fmt is None:
            return UNQUANTIZED  # a type the kernels do not run: dequantized at load
        if fmt not in self._methods:
            self._methods[fmt] = WoqLinearMethod(*fmt, name=self.name)
        return self._methods[fmt]

    def gguf_weights(self, path, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
        reader, self._reader = self._reader, None
        same_file = reader is not None and Path(path).resolve() == self.path.resolve()
        return iter_gguf_woq_weights(reader if same_file else path, hf_config, self.formats)
