"""kvray's Ray Serve entry point.

serve run serve_app:app                                   # bundled SmolLM2, 1 replica
serve run serve_app:build_app model=/path max_replicas=4  # any key of cluster.app_config
serve run serve_config.yaml                               # the same keys under `args:`
serve run serve_config_multi.yaml                         # several models (`models:`)
"""

from __future__ import annotations

from typing import Any

from cluster.topology import use_serve_fast_path

# `serve run` imports this module before it starts a local Ray: the proxy it starts then
# reads Serve's fast-path settings from this environment.
use_serve_fast_path()

from cluster.app_config import load_app_config  # noqa: E402
from cluster.deployments import build_openai_app  # noqa: E402


def build_app(args: dict[str, Any]) -> Any:
    """Serve application builder: validates `args` (ValueError naming a bad key) and binds."""
    return build_openai_app(load_app_config(args))


app = build_app({})
