"""/health of the ingress without Ray: a JSON answer that says whether a replica is up."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from cluster.app_config import load_app_config
from cluster.local_server import LocalServer
from tests.support.outside_serve import build_ingress

pytestmark = pytest.mark.usefixtures("outside_serve")


class _Host:
    """The part of an LLMServer that /health asks."""

    def __init__(self, healthy: bool = True) -> None:
        self.healthy = healthy

    def is_healthy(self) -> bool:
        return self.healthy


def _get(server: Any, path: str, args: dict | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        ingress = await build_ingress(server, load_app_config(args or {}))
        transport = httpx.ASGITransport(app=ingress.__serve_build_asgi_app__())
        async with httpx.AsyncClient(transport=transport, base_url="http://kvray") as client:
            return await client.get(path)

    return asyncio.run(go())


def test_a_healthy_app_answers_health_with_json():
    r = _get(LocalServer(_Host(), 8), "/health")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"status": "healthy", "models": ["SmolLM2-135M-Instruct"]}
