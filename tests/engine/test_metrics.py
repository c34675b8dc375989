"""Engine metrics through prometheus-client: counts that must agree with what the engine did."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.observability.metrics import METRICS, PrometheusSink

LABELS = {"replica": "0", "model": "tiny-llama"}


def _llm(**engine_args) -> LLM:
    args = {"max_model_len": 256, "block_size": 16} | engine_args
    return LLM(model="tiny-llama", load_format="dummy", **args)


def _sink(llm: LLM, flush_interval_s: float = 0.0) -> PrometheusSink:
    sink = PrometheusSink(const_labels={"replica": "0"})
    llm.engine.enable_metrics(sink, flush_interval_s=flush_interval_s)
    return sink


def _value(sink: PrometheusSink, name: str, **labels: str) -> float | None:
    return sink.registry.get_sample_value(name, LABELS | labels)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40_000) for _ in range(rng.randint(5, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return _llm(num_gpu_blocks=64)


def test_counters_and_histograms_match_the_requests(llm):
    sink = _sink(llm)
    prompts = _prompts(3, seed=1)
    max_tokens = [4, 7, 10]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens

    num_prompt = sum(len(p) for p in prompts)
    assert _value(sink, "kvray_prompt_tokens_total") == num_prompt
    assert _value(sink, "kvray_generation_tokens_total") == sum(max_tokens)
    assert _value(sink, "kvray_request_success_total", finished_reason="length") == 3
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert _value(sink, f"kvray_{name}_seconds_count") == 3
    # One inter-token gap per token after the first.
    assert _value(sink, "kvray_inter_token_latency_seconds_count") == sum(max_tokens) - 3
    ttft = _value(sink, "kvray_time_to_first_token_seconds_sum")
    assert 0 < ttft <= _value(sink, "kvray_e2e_request_latency_seconds_sum")
    # Every prompt token is computed once, and every generated token but the last.
    computed = num_prompt + sum(max_tokens) - 3
    assert _value(sink, "kvray_iteration_tokens_sum") == computed
    # All three fit one batch: every step runs one request per unfinished one.
    assert _value(sink, "kvray_batch_size_sum") == sum(max_tokens)
    assert _value(sink, "kvray_batch_size_count") == max(max_tokens)
    # Idle again: gauges are back at zero.
    assert _value(sink, "kvray_num_requests_running") == 0
    assert _value(sink, "kvray_num_requests_waiting") == 0
    assert _value(sink, "kvray_kv_cache_usage_perc") == 0


def test_gauges_show_the_running_batch(llm):
    sink = _sink(llm)
    engine = llm.engine
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    # 17 and 20 tokens: each needs 2 blocks of 16, so slots are partly empty.
    engine.add_request("a", list(range(100, 117)), params)
    engine.add_request("b", list(range(200, 220)), params)
    engine.step()
    assert _value(sink, "kvray_num_requests_running") == 2
    assert _value(sink, "kvray_kv_cache_usage_perc") == pytest.approx(4 / 63)
    assert _value(sink, "kvray_kv_cache_fragmentation_perc") == pytest.approx(1 - 37 / 64)
    while engine.has_unfinished_requests():
        engine.step()
    assert _value(sink, "kvray_kv_cache_fragmentation_perc") == 0


def test_prefix_hits_and_preemptions_match_the_scheduler():
    llm = _llm(num_gpu_blocks=8, max_num_seqs=4)
    sink = _sink(llm)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    # Four requests of 2 blocks that grow to 4: seven blocks cannot hold them all.
    llm.generate(_prompts(4, seed=2), params)
    prompt = list(range(300, 340))
    llm.generate(prompt, SamplingParams(max_tokens=1))
    llm.generate(prompt, SamplingParams(max_tokens=1))

    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0
    assert _value(sink, "kvray_num_preemptions_total") == stats["num_preemptions"]
    assert stats["prefix_cache_hits"] >= 32
    assert _value(sink, "kvray_prefix_cache_hits_total") == stats["prefix_cache_hits"]
    assert _value(sink, "kvray_prefix_cache_queries_total") == stats["prefix_cache_queries"]
    # A preempted request is queued once: its wait is measured to its first schedule only.
    assert _value(sink, "kvray_request_queue_time_seconds_count") == 6


def test_flushes_are_batched_but_an_idle_engine_flushes_at_once(llm):
    sink = _sink(llm, flush_interval_s=3600)
    engine = llm.engine
    engine.add_request("x", list(range(500, 520)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("y", list(range(600, 620)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.step()
    # Busy and within the interval: nothing reached the sink yet.
    assert _value(sink, "kvray_generation_tokens_total") is None
    assert _value(sink, "kvray_num_requests_running") is None
    # "y" finishes ("x" still runs); with steps overlapped its output may come a call later.
    while not any(o.request_id == "y" and o.finished for o in engine.step()):
        pass
    engine.abort_request(["x"])
    assert _value(sink, "kvray_request_success_total", finished_reason="abort") == 1
    assert _value(sink, "kvray_request_success_total", finished_reason="length") == 1
    assert _value(sink, "kvray_generation_tokens_total") == 6
    assert _value(sink, "kvray_num_requests_running") == 0


def test_every_metric_is_exported_with_its_labels():
    sink = PrometheusSink(const_labels={"replica": "r1"})
    for m in METRICS:
        labels = {label: "v" for label in m.labels}
        getattr(sink, {"counter": "inc", "gauge": "set", "histogram": "observe"}[m.kind])(
            m.name, 1.0, labels
        )
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(sink.registry).decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for m in METRICS:
        assert m.exported_names() <= names, m.name
        assert m.name.startswith("kvray_")
    assert sink.registry.get_sample_value(
        "kvray_tenant_rejections_total",
        {"replica": "r1", "model": "v", "tenant": "v", "reason": "v"},
    )


def test_bad_flush_interval_is_refused(llm):
    with pytest.raises(ValueError, match="flush_interval_s"):
        llm.engine.enable_metrics(PrometheusSink(), flush_interval_s=-1)
