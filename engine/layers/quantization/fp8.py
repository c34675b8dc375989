"""FP8 W8A8 (float8 e4m3) linear layers: HF "fp8" checkpoints, compressed-tensors FP8, and
16-bit checkpoints quantized at load.

Weights are float8_e4m3fn [out, in] with one float32 scale per output channel: a checkpoint's
per-tensor scale of q, k or v fills its shard's channels, so a fused layer keeps every shard's
own scale (no re-quantization to a common one). Block-wise checkpoints (DeepSeek, Qwen3 FP8:
`weight_scale_inv` [out/128, in/128]) keep their block scales, one row of them per output
channel. Activations are quantized per
token at run time, or with the checkpoint's static `input_scale` (the largest of a fused
layer's shards).
"""

from __future__ import annotations

import re
from typing import Any

import torch

import kernels
from engine.layers.quantization.base import (
    UNQUANTIZED,
    LinearMethod,
    QuantConfig,
    empty_param,
    replace_param,
    require_fp8,
)

FP8 = torch.float8_e4m3fn


class Fp8LinearMethod(LinearMethod):
    """One layer's FP8 weights; `stored`: what the checkpoint holds ("16-bit" quantizes at
    load, "tensor" / "channel" scales, or "block")."""

    name = "fp8"

    def __init__(
        self, stored: str, static_input: bool = False, block: tuple[int, int] = (128, 128)
    ):
        self.stored = stored
        self.static_input = static_input
        self.block = block

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        out = sum(output_sizes)
        dtype = params_dtype if self.stored == "16-bit" else FP8
        layer.register_parameter(
            "weight", empty_param(out, input_size, dtype=dtype, output_dim=0, input_dim=1)
        )
        if self.stored in ("tensor", "channel"):
            shape = (out, 1) if self.stored == "channel" else (out,)
            scale = empty_param(*shape, dtype=torch.float32, output_dim=0)
            layer.register_parameter("weight_scale", scale)
        elif self.stored == "block":
            rows, cols = self.block
            # One row of block scales per output channel: q, k and v shards that start
            # inside a 128-row block (576-wide q of SmolLM2) still load exactly.
            scale = empty_param(
                out,
                -(-input_size // cols),
                dtype=torch.float32,
                output_dim=0,
                output_repeat=rows,
                input_dim=1,
                input_pack=cols,
            )
            layer.register_parameter("weight_scale_inv", scale)
        if self.static_input:
            # Loaded once per fused shard; 0 until then, and the largest stays.
            scalar = empty_param(dtype=torch.float32, combine="max")
            layer.register_parameter("input_scale", scalar)
            layer.input_scale.data.zero_()

    def process_weights_after_loading(self, layer):
        if self.stored == "16-bit":
            weight, scale = kernels.quantize_fp8(layer.weight.data, per_channel=True)
            replace_param(layer, "weight", weight)
            layer.register_parameter(
                "weight_scale", torch.nn.Parameter(scale.reshape(-1), requires_grad=False)
            )
        elif self.stored == "channel":
            replace_param(layer, "weight_scale", layer.weight_scale.data.reshape(-1))

    def apply(self, layer, x, bias=None):
        if self.stored == "block":
            # the scales were loaded one row per output channel: blocks of (1, columns)
            return kernels.fp8_block_linear(
                x, layer.weight, layer.weight_scale_inv, bias, block=(1, self.block[1])
            )
        input_scale = layer.input_scale if self.static_input else None
        return kernels.fp8_linear(x, layer.weight, layer.weight_scale, input_scale, bias)


def _ignored(patterns: list[str], name: str) -> bool:
    """Whether a checkpoint module is listed as left unquantized: its name, a suffix of
    it at a dot, or compressed-tensors' "re:<regex>"."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


class _Fp8ConfigBase(QuantConfig):
    name = "fp8"

    def __init__(self, method: Fp8LinearMethod, ignored: list[str]):
        self.method = method
        self.ignored = ignored

    def linear_method(self, prefix: str, shards: list[str]) -> LinearMethod:
        skipped = [_ignored(self.ignored, shard) for shard in shards]
        if all(skipped):
            return UNQUANTIZED
        if any(skipped):
            raise ValueError(
                f"{prefix}: the checkpoint leaves some of {', '.join(shards)} unquantized; "
                "a fused layer must be quantized in all its parts or none"
            )
        return self.method


class Fp8Config(_Fp8ConfigBase):
    """quant_method "fp8" (tensors `weight`, `weight_scale` or block `weight_scale_inv`,
    optional `input_scale`), or no quantization_config: 16-bit weights quantized at load."""

    @classmethod
    def create(cls, hf_config: Any, model: str | None, device) -> Fp8Config:
        require_fp8(device, "quantization")
        stored = getattr(hf_config, "quantization_config", None)
        if stored is None:
            return cls(Fp8LinearMethod("16-bit"), [])
        scheme = stored.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(
                f"quantization_config.activation_scheme={scheme!r}: expected dynamic or static"
            )
        block = stored.get("weight_block_size")
        if block is not None:
            if scheme == "static":
                raise ValueError("block-wise fp8 takes activation_scheme='dynamic' only")
            method = Fp8LinearMethod("block", block=tuple(int(b) for b in block))
        else:
            method = Fp8LinearMethod("tensor", static_input=scheme == "static")
        ignored = stored.get("ignored_layers") or stored.get("modules_to_not_convert") or []
        return cls(method, list(ignored))


class CompressedTensorsFp8Config(_Fp8ConfigBase):
    """quant_method "compressed-tensors" with 8-bit float weights (strategy "tensor" or
    "channel": `weight_scale` [out, 1]) and dynamic per-token or static activations."""

    name = "compressed-tensors"

    @classmethod
    def create(cls, hf_config: Any, model: str | None, device) -> CompressedTensorsFp8Config:
        require_fp8(device, "quantization")
        stored = hf_config.quantization_config
        groups = list((stored.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors: kvray runs one config group, got {len(groups)}")
        weights = groups[0].get("weights") or {}
        acts = groups[0].get("input_activations") or {}
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            raise ValueError(
                "compressed-tensors: only 8-bit float (FP8) weights run; this checkpoint has "
                f"{weights.get('num_bits')}-bit {weights.get('type')} weights"
            )
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel"):
            raise ValueError(
                f"compressed-tensors: weight strategy {strategy!r}: expected tensor or channel"
            )
        if acts and acts.get("strategy") not in (None, "tensor", "token"):
            raise ValueError(
                f"compressed-tensors: activation strategy {acts.get('strategy')!r}: "
                "expected token (dynamic) or tensor"
            )
        static = bool(acts) and not acts.get("dynamic", True)
        method = Fp8LinearMethod(strategy, static_input=static)
        return cls(method, list(stored.get("ignore") or []))
