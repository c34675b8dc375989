"""vLLM's per-request `cache_salt` through the real engine: requests share a prompt's
cached blocks only when both their tenant and their own salt agree."""

from __future__ import annotations

import asyncio

import pytest

from engine.api.protocol import CompletionRequest
from engine.api.serving import OpenAIServing, RequestContext
from engine.async_engine import AsyncEngine
from tests.test_parallel import TINY_ARGS, write_tiny_llama

PROMPT = list(range(3, 23))  # five full blocks of 4


@pytest.fixture
def served(tmp_path):
    engine = AsyncEngine.from_engine_args(
        write_tiny_llama(tmp_path), engine_process=False, **TINY_ARGS
    )
    yield OpenAIServing(engine), engine
    engine.shutdown()


def _new_hits(served, tenant: str | None, salt: str | None) -> int:
    """Prefix-cache hits (in tokens) of one completion of PROMPT."""
    serving, engine = served
    request = CompletionRequest(prompt=PROMPT, max_tokens=1, cache_salt=salt)

    async def run() -> int:
        before = (await engine.stats())["prefix_cache_hits"]
        await serving.create_completion(request, RequestContext(cache_salt=tenant))
        return (await engine.stats())["prefix_cache_hits"] - before

    return asyncio.run(run())


def test_the_same_salt_shares_blocks_another_does_not(served):
    assert _new_hits(served, "tenant-a", "x") == 0
    assert _new_hits(served, "tenant-a", "x") > 0
    assert _new_hits(served, "tenant-a", "y") == 0
    assert _new_hits(served, "tenant-a", None) == 0
    assert _new_hits(served, "tenant-b", "x") == 0
    assert _new_hits(served, "tenant-b", "x") > 0
