"""The model lifecycle on a GPU, CUDA graphs on: weights copied in place keep the captured
graphs valid (the tokens are a fresh engine's), the weight cache holds pinned copies, sleep
frees the device memory and wake-up (graphs captured again) gives the same tokens; a quantized
(AWQ) model's weights are staged on the device. Run on the device:
`pytest -m gpu tests/gpu/test_model_lifecycle_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.support.quantizers import int4_checkpoint
from tests.support.random_checkpoints import PROMPTS, random_llama_weights, write_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ARGS = dict(max_model_len=256, gpu_memory_utilization=0.3, max_num_seqs=8)
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _fresh(path: str) -> list[list[int]]:
    llm = LLM(path, **ARGS)
    try:
        return _tokens(llm)
    finally:
        llm.engine.shutdown()


def _other(weights: dict) -> dict:
    return {k: v * 1.5 if v.dim() == 2 else v for k, v in weights.items()}


@pytest.fixture(scope="module")
def floats(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle-gpu")
    weights = random_llama_weights()
    a, b = write_llama(root / "a", weights), write_llama(root / "b", _other(weights))
    return a, b, _fresh(a), _fresh(b)


def test_weights_in_place_keep_the_graphs_and_the_cache_is_pinned(floats):
    a, b, want_a, want_b = floats
    assert want_a != want_b
    llm = LLM(a, weight_cache_gb=0.5, **ARGS)
    runner = llm.engine.executor.worker.runner
    assert runner.cuda_graphs is not None
    pointers = [p.data_ptr() for p in runner.model.parameters()]
    llm.load_model(b, weights_only=True)
    assert [p.data_ptr() for p in runner.model.parameters()] == pointers
    assert _tokens(llm) == want_b  # decode steps replay the graphs captured over a's tensors
    llm.load_model(a, weights_only=True)
    assert _tokens(llm) == want_a
    entries = list(runner.weights.cache._entries.values())
    assert len(entries) == 2
    assert all(t.is_pinned() for entry in entries for t in entry.values())
    llm.engine.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_device_and_wake_up_gives_the_same_tokens(floats, level):
    a, _, want_a, _ = floats
    llm = LLM(a, weight_cache_gb=0.5, **ARGS)
    weight_bytes = llm.engine.executor.step_weight_bytes()
    kv_bytes = sum(
        c.numel() * c.element_size() for c in llm.engine.executor.worker.runner.kv_caches
    )
    awake = torch.cuda.memory_allocated()
    llm.sleep(level)
    assert torch.cuda.memory_allocated() <= awake - weight_bytes - kv_bytes
    llm.wake_up()
    assert _tokens(llm) == want_a
    llm.engine.shutdown()


def test_a_quantized_model_switches_weights_through_device_staging(tmp_path):
    weights = random_llama_weights()
    a = write_llama(tmp_path / "a", int4_checkpoint(weights, AWQ)[0], AWQ)
    b = write_llama(tmp_path / "b", int4_checkpoint(_other(weights), AWQ)[0], AWQ)
    want_b = _fresh(b)
    llm = LLM(a, **ARGS)
    assert llm.engine.config.model.quantization == "awq"
    llm.load_model(b, weights_only=True)
    assert _tokens(llm) == want_b
    llm.sleep(1)
    llm.wake_up()
    assert _tokens(llm) == want_b
    llm.engine.shutdown()
