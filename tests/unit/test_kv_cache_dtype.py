"""The engine key kv_cache_dtype: its values, the GPUs fp8 needs, the block size in bytes,
the start-up capacity line, and where a checkpoint's KV scales load."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from engine.config import EngineArgs, EngineConfig
from engine.layers.attention import Attention, kv_scale_target, load_kv_scale
from engine.worker import kv_memory
from engine.worker.kv_memory import allocate_kv_caches, kv_block_bytes, kv_cache_torch_dtype

CUDA = torch.device("cuda", 0)


def test_kv_cache_dtype_takes_auto_or_fp8_and_names_itself_otherwise():
    assert EngineConfig.create(device="cpu").cache_config.kv_cache_dtype == "auto"
    config = EngineConfig.create(device="cpu", kv_cache_dtype="fp8")
    assert config.cache_config.kv_cache_dtype == "fp8"
    for bad in ("fp16", "FP8", "fp8_e5m2", 8):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineArgs(kv_cache_dtype=bad)


def test_fp8_needs_a_gpu_with_float8_conversions(monkeypatch):
    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability["value"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs .* 8\.9 .*A100 has 8\.0"):
        kv_cache_torch_dtype("fp8", torch.bfloat16, CUDA)
    assert kv_cache_torch_dtype("auto", torch.bfloat16, CUDA) == torch.bfloat16
    for supported in ((8, 9), (9, 0), (10, 0)):
        capability["value"] = supported
        assert kv_cache_torch_dtype("fp8", torch.bfloat16, CUDA) == torch.float8_e4m3fn
    cpu = torch.device("cpu")
    assert kv_cache_torch_dtype("fp8", torch.float32, cpu) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("auto", torch.float32, cpu) == torch.float32


def _attention_stack(num_layers: int = 3) -> nn.Module:
    return nn.ModuleList(Attention(8, 64, 0.125, num_kv_heads=2) for _ in range(num_layers))


def test_an_fp8_block_takes_half_the_bytes_of_a_16_bit_one():
    model = _attention_stack()
    bf16 = kv_block_bytes(model, 16, torch.bfloat16)
    assert bf16 == 3 * 2 * 16 * 2 * 64 * 2
    assert kv_block_bytes(model, 16, torch.float8_e4m3fn) * 2 == bf16


def test_the_start_up_line_names_the_cache_dtype_and_its_tokens(caplog):
    model = _attention_stack()
    with caplog.at_level(logging.INFO, logger=kv_memory.__name__):
        caches = allocate_kv_caches(model, 9, 16, torch.float8_e4m3fn, torch.device("cpu"))
    assert all(c.dtype == torch.float8_e4m3fn and c.shape == (2, 9, 16, 2, 64) for c in caches)
    # Block 0 is the null block: 8 blocks of 16 tokens hold tokens.
    assert "KV cache: float8_e4m3fn, 128 tokens (8 blocks of 16)" in caplog.text


def test_checkpoint_kv_scale_names_route_to_the_attention_buffers():
    layer = "model.layers.7.self_attn"
    assert kv_scale_target(f"{layer}.k_scale") == f"{layer}.attn.k_scale"
    assert kv_scale_target(f"{layer}.v_scale") == f"{layer}.attn.v_scale"
    assert kv_scale_target(f"{layer}.k_proj.output_scale") == f"{layer}.attn.k_scale"
    assert kv_scale_target(f"{layer}.v_proj.output_scale") == f"{layer}.attn.v_scale"
    for other in ("k_proj.weight", "k_proj.weight_scale", "q_proj.output_scale", "attn.k_scale"):
        assert kv_scale_target(f"{layer}.{other}") is None


def test_a_kv_scale_loads_as_one_positive_float32_number():
    attention = Attention(8, 64, 0.125, num_kv_heads=2)
    assert attention.k_scale.item() == attention.v_scale.item() == 1.0
    load_kv_scale(attention.k_scale, torch.tensor([0.25], dtype=torch.bfloat16))
    assert attention.k_scale.dtype == torch.float32 and attention.k_scale.item() == 0.25
    with pytest.raises(ValueError, match="one number per layer, got shape \\(2,\\)"):
        load_kv_scale(attention.v_scale, torch.tensor([0.5, 0.5]))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive and finite"):
            load_kv_scale(attention.v_scale, torch.tensor(bad))
    assert attention.v_scale.item() == 1.0
