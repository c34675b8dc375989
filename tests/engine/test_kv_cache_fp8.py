"""kv_cache_dtype="fp8" end to end on CPU (the torch references): the checkpoint's KV
scales reach the layers, the cache holds about twice the tokens of a 16-bit one (four
times the CPU's float32 one), and greedy decoding follows the unquantized cache's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers.attention import attention_layers
from tests.support.tiny_models import write_tiny_llama

# Per layer of the tiny Llama: the checkpoint's KV scale tensors (layer 2 has none).
SCALE_TENSORS = {
    "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
    "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
    "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.125]),
    "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(2.0),
    "model.layers.3.self_attn.k_scale": torch.tensor([0.75], dtype=torch.bfloat16),
}
LAYER_SCALES = [(0.5, 0.25), (0.125, 2.0), (1.0, 1.0), (0.75, 1.0)]
TINY = dict(max_model_len=128, block_size=4, cpu_kv_cache_gib=2**-10)
PROMPTS = [[5, 17, 99, 3, 42, 7, 130, 250, 11], [200, 1, 64], list(range(90, 130))]


@pytest.fixture(scope="module")
def scaled_tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-kv-fp8")
    write_tiny_llama(folder)
    weights = load_file(folder / "model.safetensors")
    save_file(weights | SCALE_TENSORS, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def _runner(llm: LLM):
    return llm.engine.executor.worker.runner


def _greedy(llm: LLM, prompts, max_tokens: int, prompt_logprobs: int | None = None):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=1,
        prompt_logprobs=prompt_logprobs,
    )
    return llm.generate(prompts, params)


def _assert_follows(fp8, reference, num_tokens: int, tolerance: float) -> None:
    """The first num_tokens greedy tokens equal, and every logprob of them within tolerance."""
    for a, b in zip(fp8, reference, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids[:num_tokens] == b.token_ids[:num_tokens]
        for x, y in zip(a.logprobs[:num_tokens], b.logprobs[:num_tokens]):
            assert abs(x.logprob - y.logprob) <= tolerance, (x, y)


def test_fp8_cache_loads_the_checkpoint_scales_and_follows_the_float_cache(scaled_tiny_folder):
    fp8 = LLM(scaled_tiny_folder, kv_cache_dtype="fp8", **TINY)
    auto = LLM(scaled_tiny_folder, **TINY)
    layers = attention_layers(_runner(fp8).model)
    assert [(a.k_scale.item(), a.v_scale.item()) for a in layers] == LAYER_SCALES
    assert all(a.k_scale.dtype == torch.float32 for a in layers)
    assert _runner(fp8).kv_caches[0].dtype == torch.float8_e4m3fn
    assert _runner(auto).kv_caches[0].dtype == torch.float32
    # The same bytes: one byte an entry against float32's four (a 16-bit cache's two).
    assert fp8.engine.num_gpu_blocks // 4 == auto.engine.num_gpu_blocks
    # Every prompt token's logprob: each prefill step reads its prompt's keys and values
    # back from the cache. (The random model's greedy tokens hang on near-ties: the bundled
    # model's test below compares those.) fp8 keeps 3 mantissa bits of each key and value,
    # which moves this model's logprobs by 0.03 on average, 0.08 at most.
    fp8_out, auto_out = _greedy(fp8, PROMPTS, 1, 0), _greedy(auto, PROMPTS, 1, 0)
    gaps = [
        abs(x.logprob - y.logprob)
        for a, b in zip(fp8_out, auto_out)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)
    ]
    assert len(gaps) == sum(len(p) - 1 for p in PROMPTS)
    assert max(gaps) <= 0.15 and sum(gaps) / len(gaps) <= 0.06


def test_the_bundled_model_with_an_fp8_cache_follows_the_float_cache(bundled_llm, monkeypatch):
    """The bundled SmolLM2 with kv_cache_dtype="fp8" against `bundled_llm` (float32 cache);
    its config, tokenizer and weights come from that engine (reading the GGUF file again
    takes seconds)."""
    import engine.llm_engine as llm_engine
    import engine.worker.weight_lifecycle as weight_lifecycle

    loaded = _runner(bundled_llm).model

    def copy_of_loaded(source, hf_config, dtype, device, **kwargs):
        model = type(loaded)(hf_config)
        model.load_state_dict(loaded.state_dict())
        return model.eval()

    monkeypatch.setattr(llm_engine, "load_hf_config", lambda source: bundled_llm.engine.hf_config)
    monkeypatch.setattr(llm_engine, "load_tokenizer_for", lambda *a: bundled_llm.get_tokenizer())
    monkeypatch.setattr(weight_lifecycle, "load_model", copy_of_loaded)
    fp8 = LLM(kv_cache_dtype="fp8")
    assert fp8.engine.num_gpu_blocks // 4 == bundled_llm.engine.num_gpu_blocks
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    # The largest gap seen is 0.15 (a token of probability about 0.5).
    _assert_follows(_greedy(fp8, prompts, 6), _greedy(bundled_llm, prompts, 6), 6, tolerance=0.3)
