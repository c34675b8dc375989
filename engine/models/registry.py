"""HF `architectures` name -> model class, with plugins from the environment.

The switch `kvray_env.MODELS`, "Arch=package.module:Class,Arch2=pkg.mod:Other", adds (or
overrides) entries without touching kvray; it is read at every lookup.
"""

from __future__ import annotations

import importlib
from typing import Any

import kvray_env
from engine.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

PLUGIN_ENV = kvray_env.MODELS.name

_MODELS: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# Configs read from GGUF metadata carry a model_type but no architectures.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def architectures_of(hf_config: Any) -> list[str]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        model_type = getattr(hf_config, "model_type", None)
        if model_type in _MODEL_TYPE_TO_ARCH:
            archs = [_MODEL_TYPE_TO_ARCH[model_type]]
    return archs


def _plugin_entries() -> dict[str, str]:
    entries: dict[str, str] = {}
    for entry in kvray_env.model_plugins().split(","):
        entry = entry.strip()
        if not entry:
            continue
        arch, sep, target = (s.strip() for s in entry.partition("="))
        module, colon, cls = target.partition(":")
        if not (sep and arch and module and colon and cls):
            raise ValueError(
                f"malformed {PLUGIN_ENV} entry {entry!r}: expected Arch=package.module:Class"
            )
        entries[arch] = target
    return entries


def _import_plugin(arch: str, target: str) -> type:
    module_name, _, cls_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{PLUGIN_ENV} entry {arch}={target}: cannot import it ({e})") from e
    if not isinstance(cls, type):
        raise ValueError(f"{PLUGIN_ENV} entry {arch}={target} is not a class")
    return cls


def supported_architectures() -> list[str]:
    return sorted(set(_MODELS) | set(_plugin_entries()))


def get_model_class(architectures: list[str]) -> type:
    """The class for the first supported name in `architectures`; plugins win over built-ins."""
    plugins = _plugin_entries()
    for arch in architectures or []:
        if arch in plugins:
            return _import_plugin(arch, plugins[arch])
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"unsupported model architecture(s) {list(architectures or [])}; supported: "
        f"{', '.join(supported_architectures())} (add more with {PLUGIN_ENV}=Arch=module:Class)"
    )
