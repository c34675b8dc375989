"""`tenant_id` at the engine (offline `LLM` and `AsyncLLMEngine`), on a tiny random Llama
with a word tokenizer: a tenant's own prefix cache, its priority, its limits and its
metrics, from the same `TenantConfig` the HTTP ingress reads."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from bench.word_tokenizer import write_word_tokenizer
from engine import LLM, AsyncLLMEngine, SamplingParams, TenantConfig, TenantLimitError
from engine.observability.metrics import PrometheusSink
from tests.support.tiny_models import TINY_ARGS, write_tiny_llama

PROMPT = " ".join(f"t{i}" for i in range(3, 23))  # 20 tokens: five full blocks of 4
GREEDY = SamplingParams(temperature=0, max_tokens=2)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_llama(folder)
    write_word_tokenizer(folder, vocab_size=256)
    return str(folder)


def _prometheus() -> tuple[PrometheusSink, CollectorRegistry]:
    registry = CollectorRegistry()
    return PrometheusSink(registry), registry


def _tokens(registry: CollectorRegistry, tenant: str, kind: str) -> float | None:
    labels = {"model": "tiny", "tenant": tenant, "kind": kind}
    return registry.get_sample_value("kvray_tenant_tokens_total", labels)


def test_two_tenants_with_one_prompt_share_no_cached_blocks(tiny_folder):
    llm = LLM(tiny_folder, served_model_name="tiny", **TINY_ARGS)

    def cached(tenant: str | None) -> int:
        return llm.generate(PROMPT, GREEDY, tenant_id=tenant)[0].num_cached_tokens

    assert cached("tenant_1") == 0
    assert cached("tenant_1") > 0  # its own blocks, hit again
    assert cached("tenant_2") == 0  # the same prompt, another tenant: no hit
    assert cached(None) == 0  # nor a request of no tenant
    assert cached("tenant_2") > 0
    llm.engine.scheduler.kv_cache_manager.check_invariants()


def test_a_tenants_configured_salt_is_the_cache_it_shares(tiny_folder):
    tenants = {"a": {"cache_salt": "shared"}, "b": TenantConfig(cache_salt="shared")}
    llm = LLM(tiny_folder, tenants=tenants, **TINY_ARGS)
    assert llm.generate(PROMPT, GREEDY, tenant_id="a")[0].num_cached_tokens == 0
    assert llm.generate(PROMPT, GREEDY, tenant_id="b")[0].num_cached_tokens > 0


def test_the_async_engine_keeps_each_tenants_cache_its_own(tiny_folder):
    engine = AsyncLLMEngine.from_pretrained(tiny_folder, engine_process=False, **TINY_ARGS)

    async def cached(tenant: str) -> int:
        [output] = await engine.generate(PROMPT, GREEDY, tenant_id=tenant)
        return output.num_cached_tokens

    async def run() -> list[int]:
        return [await cached(t) for t in ("tenant_1", "tenant_2", "tenant_1")]

    try:
        first, other, again = asyncio.run(run())
    finally:
        engine.shutdown()
    assert first == other == 0 and again > 0


def _finishing_order(tiny_folder, **keys) -> tuple[list[str], int]:
    """Tenant "low" sends first, "high" right after; the KV cache holds one of them to the
    end but not both, so one is preempted. The tenants in the order they finished, and the
    preemptions."""
    engine = AsyncLLMEngine.from_pretrained(
        tiny_folder, engine_process=False, max_model_len=128, block_size=4, num_gpu_blocks=16,
        **keys,
    )  # fmt: skip
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = " ".join(f"t{i}" for i in range(3, 11))  # 2 blocks; 12 blocks by the end
    finished: list[str] = []

    async def send(tenant: str) -> None:
        await engine.generate(prompt, long, tenant_id=tenant)
        finished.append(tenant)

    async def run() -> int:
        low = asyncio.ensure_future(send("low"))
        await asyncio.sleep(0)  # low's request is submitted first
        await asyncio.gather(low, send("high"))
        return (await engine.stats())["num_preemptions"]

    try:
        return finished, asyncio.run(run())
    finally:
        engine.shutdown()


def test_a_more_urgent_tenant_preempts_the_other(tiny_folder):
    tenants = {"low": {"priority": 1}, "high": {"priority": 0}}
    finished, preemptions = _finishing_order(tiny_folder, tenants=tenants)
    assert preemptions > 0
    assert finished == ["high", "low"]
    # With equal priorities the later arrival is the one preempted.
    finished, preemptions = _finishing_order(tiny_folder, tenants={"low": {}, "high": {}})
    assert preemptions > 0
    assert finished == ["low", "high"]


def test_tenants_with_priorities_refuse_a_policy_that_ignores_them(tiny_folder):
    with pytest.raises(ValueError, match=r"policy fcfs ignores priorities.*tenants\.low\.priority"):
        LLM(tiny_folder, tenants={"low": {"priority": 2}}, policy="fcfs", **TINY_ARGS)
    with pytest.raises(
        ValueError, match=r"tenants\.low\.priority: Input should be a valid integer"
    ):
        LLM(tiny_folder, tenants={"low": {"priority": "soon"}}, **TINY_ARGS)
    with pytest.raises(ValueError, match=r"tenants\.low\.weight: Extra inputs are not permitted"):
        AsyncLLMEngine.from_pretrained(tiny_folder, tenants={"low": {"weight": 2}})


def test_each_tenants_tokens_carry_its_label_offline(tiny_folder):
    llm = LLM(tiny_folder, served_model_name="tiny", **TINY_ARGS)
    sink, registry = _prometheus()
    llm.engine.enable_metrics(sink)
    llm.generate([PROMPT, PROMPT], GREEDY, tenant_id="tenant_1")
    llm.generate(PROMPT, GREEDY, tenant_id="tenant_2")
    assert _tokens(registry, "tenant_1", "prompt") == 40
    assert _tokens(registry, "tenant_1", "generation") == 4
    assert _tokens(registry, "tenant_2", "prompt") == 20
    assert _tokens(registry, "tenant_2", "generation") == 2


def test_a_tenants_limits_refuse_with_its_label_in_the_metrics(tiny_folder):
    tenants = {"capped": {"max_concurrent_requests": 1}, "metered": {"tokens_per_minute": 30}}
    engine = AsyncLLMEngine.from_pretrained(
        tiny_folder, tenants=tenants, engine_process=False, served_model_name="tiny", **TINY_ARGS
    )
    sink, registry = _prometheus()
    engine.enable_metrics(sink)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def run() -> None:
        stream = await engine.generate(PROMPT, long, stream=True, tenant_id="capped")
        await anext(stream)  # the capped tenant's one request is in flight
        with pytest.raises(TenantLimitError, match="'capped' has 1 requests in flight"):
            await engine.generate(PROMPT, GREEDY, tenant_id="capped")
        await stream.aclose()  # leaving the stream gives the slot back
        await engine.generate(PROMPT, GREEDY, tenant_id="capped")
        await engine.generate(PROMPT, GREEDY, tenant_id="metered")  # 22 tokens
        await engine.generate(PROMPT, GREEDY, tenant_id="metered")  # 44: over its 30
        with pytest.raises(TenantLimitError, match="'metered' used 44 tokens"):
            await engine.generate(PROMPT, GREEDY, tenant_id="metered")

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()

    def rejections(tenant: str) -> float | None:
        labels = {"model": "tiny", "tenant": tenant, "reason": "rate_limit_exceeded"}
        return registry.get_sample_value("kvray_tenant_rejections_total", labels)

    assert rejections("capped") == rejections("metered") == 1
    assert _tokens(registry, "metered", "prompt") == 40
    assert _tokens(registry, "capped", "generation") >= 2
