"""What a model's `generation_config.json` recommends: sampling defaults, an output length
and the ids that end a sequence.

A model folder's generation_config.json is where its makers put the sampling they tested
with (Llama 3.1 Instruct: temperature 0.6, top_p 0.9) and every token that ends a turn
(Llama 3.1 Instruct ends chats with <|eot_id|>, 128009, while config.json names
<|end_of_text|>, 128001, first). As vLLM does with `--generation-config auto` (its
default), requests that leave a sampling field unset take the model's value, and every
end-of-sequence id ends a request.

Settings (`generation_config`, an engine argument): "auto" reads the model folder's file
(a GGUF file carries none; the bundled model's comes with kvray, engine/bundled.py); "vllm"
(vLLM's spelling) keeps the engine's own defaults and the model's config.json EOS; any other
value is a folder holding a generation_config.json.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from engine.bundled import BUNDLED_GENERATION_CONFIG, BUNDLED_MODEL_NAME, is_bundled_model

FILE_NAME = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The generation_config.json keys that become SamplingParams defaults (vLLM takes these)."""


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, float | int] = dataclasses.field(default_factory=dict)
    """SamplingParams field -> the model's value, for fields a request leaves unset."""
    max_tokens: int | None = None
    """The file's max_new_tokens: the most a request generates unless it asks otherwise."""
    eos_token_ids: tuple[int, ...] = ()
    """The file's eos_token_id(s)."""

    def as_sampling_args(self) -> dict[str, Any]:
        """Keyword arguments of a SamplingParams made of these defaults alone."""
        args: dict[str, Any] = dict(self.sampling)
        if self.max_tokens is not None:
            args["max_tokens"] = self.max_tokens
        return args


def check_setting(setting: str) -> str:
    """ValueError unless `setting` is "auto", "vllm" or a folder with the file."""
    if setting in ("auto", "vllm"):
        return setting
    # "" would name the working directory.
    if not setting or not (Path(setting).expanduser() / FILE_NAME).is_file():
        raise ValueError(
            f'generation_config must be "auto", "vllm" or a folder holding {FILE_NAME}; '
            f"{setting!r} has no {FILE_NAME}"
        )
    return setting


def read_generation_defaults(setting: str, model_path: str | Path | None) -> GenerationDefaults:
    """The defaults `setting` names; `model_path`: the model's folder or GGUF file for
    "auto" (None for dummy weights)."""
    if setting == "vllm":
        return GenerationDefaults()
    if setting == "auto":
        if model_path is not None and is_bundled_model(model_path):
            return _defaults_from(BUNDLED_GENERATION_CONFIG, f"the bundled {BUNDLED_MODEL_NAME}")
        if model_path is None or not (Path(model_path) / FILE_NAME).is_file():
            return GenerationDefaults()
        path = Path(model_path) / FILE_NAME
    else:
        path = Path(check_setting(setting)).expanduser() / FILE_NAME
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"generation_config: {path} does not hold a JSON object")
    return _defaults_from(values, path)


def _defaults_from(values: dict[str, Any], path: Path | str) -> GenerationDefaults:
    from engine.sampling_params import SamplingParams

    sampling = {k: values[k] for k in SAMPLING_KEYS if values.get(k) is not None}
    max_tokens = values.get("max_new_tokens")
    eos = values.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    defaults = GenerationDefaults(sampling, max_tokens, eos_ids)
    try:
        SamplingParams(stop_token_ids=list(eos_ids), **defaults.as_sampling_args())
    except ValueError as e:
        raise ValueError(f"generation_config: {path}: {e}") from None
    return defaults


def config_eos_token_id(hf_config: Any) -> int | None:
    """config.json's EOS id (its first when a list): the one the model runner holds back
    while a request is under its min_tokens."""
    eos = getattr(hf_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos


def end_of_sequence_ids(hf_config: Any, tokenizer: Any, defaults: GenerationDefaults) -> list[int]:
    """Every id that ends a sequence, the one the engine calls EOS first: config.json's
    eos_token_id (its first when a list), then the rest of it, the tokenizer's EOS (vLLM's
    EOS) and the generation config's."""
    found: list[int] = []
    eos = getattr(hf_config, "eos_token_id", None)
    found += eos if isinstance(eos, list) else [eos]
    found.append(getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None)
    found += defaults.eos_token_ids
    return list(dict.fromkeys(t for t in found if isinstance(t, int)))
