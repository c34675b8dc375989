"""Which quantization method runs: the `quantization` key against the checkpoint."""

from types import SimpleNamespace

import pytest

from engine.config import EngineArgs
from engine.layers.quantization import resolve_quantization


def _hf(method=None):
    config = {"quant_method": method} if method else None
    return SimpleNamespace(quantization_config=config)


@pytest.mark.parametrize(
    ("key", "method", "model", "load_format", "device", "runs"),
    [
        ("auto", None, "/m", "auto", "cuda", "none"),
        ("auto", "fp8", "/m", "auto", "cuda", "fp8"),
        ("auto", "AWQ", "/m", "auto", "cuda", "awq"),
        ("auto", "gptq", "/m", "safetensors", "cpu", "gptq"),
        ("auto", None, "/m.gguf", "auto", "cuda", "gguf"),
        ("auto", None, "/m.gguf", "auto", "cpu", "none"),
        ("auto", None, None, "auto", "cuda", "gguf"),  # the bundled GGUF model
        ("none", None, "/m.gguf", "auto", "cuda", "none"),
        ("gguf", None, "/m.gguf", "gguf", "cpu", "gguf"),
        ("fp8", None, "/m", "auto", "cuda", "fp8"),  # quantized at load
        ("fp8", "fp8", "/m", "auto", "cuda", "fp8"),
        ("awq", None, "llama3-8b", "dummy", "cuda", "awq"),
        ("gptq", None, "llama3-8b", "dummy", "cuda", "gptq"),
        ("compressed-tensors", "compressed-tensors", "/m", "auto", "cuda", "compressed-tensors"),
    ],
)
def test_the_method_that_runs(key, method, model, load_format, device, runs):
    assert resolve_quantization(key, _hf(method), model, load_format, device) == runs


@pytest.mark.parametrize(
    ("key", "method", "model", "load_format", "message"),
    [
        ("int3", None, "/m", "auto", "quantization must be one of"),
        ("auto", "bitsandbytes", "/m", "auto", "quant_method='bitsandbytes' is not supported"),
        ("none", "awq", "/m", "auto", "quantization='none' cannot run a 'awq' checkpoint"),
        ("awq", "gptq", "/m", "auto", "does not match the checkpoint's quant_method='gptq'"),
        ("awq", None, "/m", "auto", "quantization='awq' needs a awq checkpoint"),
        ("gguf", None, "/m", "auto", "needs a .gguf model file"),
        ("fp8", None, "/m.gguf", "auto", "does not apply to a GGUF file"),
    ],
)
def test_a_pair_that_cannot_run_is_refused_naming_quantization(
    key, method, model, load_format, message
):
    with pytest.raises(ValueError, match=message):
        resolve_quantization(key, _hf(method), model, load_format, "cuda")


def test_engine_args_resolve_the_key_once_into_the_engine_config():
    args = EngineArgs(model="qwen3-0.6b", load_format="dummy", quantization="fp8", device="cpu")
    assert args.create_engine_config(_hf()).model.quantization == "fp8"
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model="qwen3-0.6b", quantization="int3")


def test_the_guides_fp8_dtype_is_fp8_weights_with_16_bit_activations():
    """`LLM(..., dtype="fp8")`: quantization="fp8" with the checkpoint's 16-bit dtype."""
    hf = SimpleNamespace(quantization_config=None, dtype="bfloat16")
    config = EngineArgs(model="/m", dtype="fp8", device="cuda").create_engine_config(hf)
    assert (config.model.dtype, config.model.quantization) == ("bfloat16", "fp8")
    with pytest.raises(ValueError, match="cannot go with quantization='awq'"):
        EngineArgs(model="/m", dtype="fp8", quantization="awq", device="cuda").create_engine_config(
            hf
        )
    with pytest.raises(ValueError, match="on cpu use dtype='auto'.*quantization='fp8'"):
        EngineArgs(model="/m", dtype="fp8", device="cpu").create_engine_config(hf)


def test_fp8_weights_on_a_gpu_without_fp8_are_refused_naming_the_key(monkeypatch):
    import torch

    from engine.layers.quantization import build_quant_config

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"quantization='fp8' needs .* A100 has 8\.0"):
        build_quant_config("fp8", _hf(), "/m", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert build_quant_config("fp8", _hf(), "/m", "cuda").name == "fp8"
