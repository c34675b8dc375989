"""The bundled GGUF kept quantized on a GPU (its Q4_1 layers through the Triton WOQ kernels)
gives the greedy tokens of the same file dequantized at load, both in bfloat16. Run on the
device: `pytest -m gpu tests/gpu/test_gguf_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.quantization.woq import WoqLinearMethod
from tests.support.bundled_checkpoints import PROMPT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [PROMPT, "The three primary colors are", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _greedy_tokens(quantization: str) -> list[list[int]]:
    llm = LLM(
        quantization=quantization, dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3
    )
    try:
        assert llm.engine.config.model.quantization == quantization
        model = llm.engine.executor.worker.runner.model
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv.method, WoqLinearMethod) == (quantization == "gguf")
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.shutdown()


def test_the_bundled_gguf_kept_quantized_gives_the_dequantized_greedy_tokens():
    # Q4_1 repacks exactly: both paths multiply the same bfloat16 weights, summed in
    # another order.
    assert _greedy_tokens("gguf") == _greedy_tokens("none")
