"""The ingress (`OpenAIIngress`) built outside Serve, for tests that drive it over ASGI.
tests/serve/conftest.py's `outside_serve` fixture stands in for what Serve's process gives
it."""

from __future__ import annotations

from typing import Any

from cluster.app_config import AppConfig
from cluster.ingress import OpenAIIngress


class NoMetrics:
    def inc(self, *args: Any) -> None:
        pass


async def build_ingress(server: Any, config: AppConfig, limiter: Any = None) -> Any:
    """The ingress of `config` over `server` (a LocalServer, or served name -> LocalServer)."""
    ingress_class = OpenAIIngress.func_or_class.__bases__[0]  # under Serve's ASGI wrapper
    ingress = ingress_class.__new__(ingress_class)
    await ingress_class.__init__(ingress, server, config, limiter)
    return ingress
