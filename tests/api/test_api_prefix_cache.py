"""The prefix cache through the API, on the real engine: vLLM's per-request `cache_salt`
(requests share a prompt's cached blocks only when both their tenant and their own salt
agree) and OpenAI's usage.prompt_tokens_details.cached_tokens."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.api.protocol import CompletionRequest
from engine.api.serving import OpenAIServing, RequestContext, SSEStream
from engine.async_engine import AsyncEngine
from tests.support.tiny_models import TINY_ARGS, write_tiny_llama

PROMPT = list(range(3, 23))  # five full blocks of 4


@pytest.fixture
def served(tmp_path):
    engine = AsyncEngine.from_engine_args(
        model=write_tiny_llama(tmp_path), engine_process=False, **TINY_ARGS
    )
    yield OpenAIServing(engine, enable_prompt_tokens_details=True), engine
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


def _usage(serving: OpenAIServing, stream: bool) -> dict:
    request = CompletionRequest(
        prompt=PROMPT,
        max_tokens=2,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
    )

    async def run() -> dict:
        response = await serving.create_completion(request, RequestContext())
        if not isinstance(response, SSEStream):
            return response.model_dump(mode="json")["usage"]
        chunks = [event async for event in response.events]
        return json.loads(chunks[-2].removeprefix("data: "))["usage"]

    return asyncio.run(run())


def test_usage_counts_the_prompt_tokens_the_cache_served(served):
    serving, engine = served
    first = _usage(serving, stream=False)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    again = _usage(serving, stream=False)
    hits = asyncio.run(engine.stats())["prefix_cache_hits"]
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] == hits < len(PROMPT)
    streamed = _usage(serving, stream=True)
    assert streamed["prompt_tokens_details"] == again["prompt_tokens_details"]
    assert streamed["prompt_tokens"] == again["prompt_tokens"] == len(PROMPT)


def test_usage_leaves_the_details_out_unless_the_server_enables_them(served):
    _, engine = served
    plain = OpenAIServing(engine)
    assert "prompt_tokens_details" not in _usage(plain, stream=False)
    assert "prompt_tokens_details" not in _usage(plain, stream=True)
