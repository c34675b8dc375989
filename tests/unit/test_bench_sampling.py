"""The sampler benchmark runs on a CPU, and the "sampled" workload is the same for kvray
(bench.suite) and vLLM (bench/vllm_anchor_bench.py)."""

import importlib.util
import json
from pathlib import Path

import pytest

from bench import sampler as sampler_bench
from bench import suite
from engine.models.shapes import get_shape_config
from engine.sampling_params import SamplingParams

BENCH = Path(suite.__file__).parent


def anchor_module():
    """The vLLM anchor script, loaded without vLLM (it imports vLLM inside main)."""
    spec = importlib.util.spec_from_file_location("vllm_anchor", BENCH / "vllm_anchor_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sampled_workload_is_drawn_alike_for_both_engines():
    anchor = anchor_module()
    for seed in (0, 5):
        ours = suite.sampled_requests(40, seed)
        assert ours == anchor.sampled_requests(40, seed)
    prompts, params = ours
    assert all(100 <= len(p) <= 1024 for p in prompts)
    assert all("seed" not in p and p["top_k"] == 50 and p["top_p"] == 0.95 for p in params)
    assert ours != suite.sampled_requests(40, 6)
    _, engine_params = suite.workload_requests("sampled", 40, None, None, 1000, 5)
    for p, q in zip(engine_params, params, strict=True):
        assert isinstance(p, SamplingParams) and p.ignore_eos
        assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.8, 0.95, 50, None)
        assert p.max_tokens == q["max_tokens"]


def test_both_engines_list_the_same_workloads_and_shapes():
    anchor = anchor_module()
    for shape, workloads in anchor.WORKLOADS.items():
        assert list(workloads) == [
            w for w in suite.WORKLOADS[shape] if w[0] not in suite.ASKED_FOR_ONLY
        ], shape
        config = anchor.shape_config(shape, "")
        ours = get_shape_config(shape)
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "tie_word_embeddings",
        ):
            assert config[key] == getattr(ours, key), (shape, key)
        assert config["architectures"] == ours.architectures


def test_the_sampler_benchmark_runs_on_a_cpu(capsys, monkeypatch, tmp_path):
    results = tmp_path / "results.jsonl"
    monkeypatch.setattr("bench.common.RESULTS", results)
    argv = ["--device", "cpu", "--batch", "6", "--vocab", "300", "--iters", "1", "--warmup", "0"]
    sampler_bench.main(argv + ["--cases", "top_p_top_k", "mixed"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["case"] for line in lines] == ["top_p_top_k", "mixed"]
    for line in lines:
        assert line["bench"] == "sampler" and line["batch_size"] == 6
        assert line["reference_ms"] > 0 and line["candidates_ms"] > 0
    assert not results.exists()
    sampler_bench.main(argv + ["--cases", "top_k", "--record"])
    assert json.loads(results.read_text())["case"] == "top_k"


@pytest.mark.parametrize("case", list(sampler_bench.CASES))
def test_every_benchmark_case_is_valid_sampling_params(case):
    assert all(isinstance(sampler_bench.CASES[case](i), SamplingParams) for i in range(16))
