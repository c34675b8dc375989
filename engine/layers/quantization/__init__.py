"""Quantized weights: which method runs, decided once from the engine key and the checkpoint.

`resolve_quantization` (torch-free: the engine config calls it) turns the `quantization`
key and the checkpoint's `quantization_config` into the method that runs, or refuses a pair
that cannot run. `build_quant_config` (on the worker, with torch) makes that method's
`QuantConfig`, whose `linear_method(prefix)` gives each linear layer its method. Embeddings,
the LM head and norms are never quantized.
"""

from __future__ import annotations

import importlib
from typing import Any

QUANTIZATION_KEYS = ("auto", "none", "fp8", "compressed-tensors", "awq", "gptq", "gguf")
"""Values of the `quantization` engine key: auto (the checkpoint's own method; a GGUF file
stays quantized on a GPU), none (16-bit weights; a GGUF file dequantized at load), or a
method by name."""

# Method -> "module:class" of its QuantConfig, imported when a model uses it.
_CONFIGS = {
    "fp8": "engine.layers.quantization.fp8:Fp8Config",
    "compressed-tensors": "engine.layers.quantization.fp8:CompressedTensorsFp8Config",
    "awq": "engine.layers.quantization.int4:AwqConfig",
    "gptq": "engine.layers.quantization.int4:GptqConfig",
    "gguf": "engine.layers.quantization.gguf:GgufConfig",
}
ONLINE = {"fp8"}
"""Methods that quantize a 16-bit checkpoint at load (vLLM's `quantization="fp8"`)."""
DUMMY = {"fp8", "awq", "gptq"}
"""Methods that dummy weights can run: random 16-bit weights quantized at load."""


def checkpoint_method(hf_config: Any) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, lower-case; None if unquantized."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else None
    method = method or getattr(config, "quant_method", None)
    return str(method).lower() if method else "unknown"


def resolve_quantization(
    key: str, hf_config: Any, model: str | None, load_format: str, device: str
) -> str:
    """The method that runs ("none" for 16-bit weights), or ValueError naming `quantization`.

    model / load_format say where the weights come from: a `.gguf` file, dummy weights, or an
    HF checkpoint whose config.json may carry a `quantization_config`. A GGUF file stays
    quantized on a GPU; on a CPU "auto" dequantizes it (the float path is the faster there).
    """
    if key not in QUANTIZATION_KEYS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_KEYS)}, got {key!r}")
    is_gguf = load_format == "gguf" or (
        load_format == "auto" and model is not None and str(model).endswith(".gguf")
    )
    if model is None and load_format == "auto":
        is_gguf = True  # the bundled model is a GGUF file
    dummy = load_format == "dummy"
    stored = None if dummy or is_gguf else checkpoint_method(hf_config)
    if stored is not None and stored not in _CONFIGS:
        raise ValueError(
            f"the checkpoint's quantization_config.quant_method={stored!r} is not supported; "
            f"kvray loads {', '.join(sorted(_CONFIGS))} checkpoints, or serve the model's "
            "16-bit checkpoint (quantization='fp8' quantizes it at load)"
        )
    if key == "auto":
        if stored is not None:
            return stored
        return "gguf" if is_gguf and device == "cuda" else "none"
    if key == "none":
        if stored is not None:
            raise ValueError(
                f"quantization='none' cannot run a {stored!r} checkpoint (its weights are "
                "stored quantized); use quantization='auto'"
            )
        return "none"
    if key == "gguf":
        if not is_gguf:
            raise ValueError("quantization='gguf' needs a .gguf model file")
        return key
    if is_gguf:
        raise ValueError(
            f"quantization={key!r} does not apply to a GGUF file: use 'auto' (kept quantized on "
            "a GPU) or 'none' (dequantized to 16-bit at load)"
        )
    if stored is not None:
        if stored != key:
            raise ValueError(
                f"quantization={key!r} does not match the checkpoint's quant_method={stored!r}; "
                "use quantization='auto'"
            )
        return key
    if key in ONLINE or (dummy and key in DUMMY):
        return key
    raise ValueError(
        f"quantization={key!r} needs a {key} checkpoint (a config.json with its "
        "quantization_config); a 16-bit checkpoint can be quantized at load with "
        "quantization='fp8'"
    )


def build_quant_config(method: str, hf_config: Any, model: str | None, device: Any):
    """The QuantConfig of a resolved method (None for "none"), checked against the device."""
    if method == "none":
        return None
    module, name = _CONFIGS[method].split(":")
    config_cls = getattr(importlib.import_module(module), name)
    return config_cls.create(hf_config, model, device)


__all__ = [
    "DUMMY",
    "ONLINE",
    "QUANTIZATION_KEYS",
    "build_quant_config",
    "checkpoint_method",
    "resolve_quantization",
]
