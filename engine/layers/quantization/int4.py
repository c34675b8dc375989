"""int4 weight-only checkpoints (W4A16): AWQ and GPTQ, repacked at load into the one
weight-only layout (engine/layers/quantization/woq.py) that the kernels read.

The checkpoint tensors are registered as the checkpoint names and shapes them (AWQ:
`qweight` int32 [K, N/8] packed along N, `qzeros`, `scales` [K/G, N]; GPTQ: `qweight`
int32 [K/8, N] packed along K, `qzeros`, `scales`, `g_idx` [K]), so tensor-parallel ranks
cut them by the framework's rule; `prepare` repacks them (int4_packing.py). GPTQ checkpoints
quantized in activation order (`desc_act`) keep a permutation of the inputs: the layer
multiplies x[:, perm]. With dummy weights (no checkpoint) the layers hold 16-bit weights
and quantize them at load by rounding to the nearest of 16 levels per group.
"""

from __future__ import annotations

from typing import Any

import torch

import kernels
from engine.layers.linear import RowParallelLinear
from engine.layers.quantization.base import UNQUANTIZED, LinearMethod, QuantConfig, empty_param
from engine.layers.quantization.int4_packing import awq_to_woq, gptq_to_woq
from engine.layers.quantization.woq import WoqLinearMethod, store_woq
from kernels.woq_ref import WOQ_GROUP_SIZES, woq_quantize_rtn


class _OnlineInt4(WoqLinearMethod):
    """Dummy weights: 16-bit `weight` [out, in], rounded to int4 groups at load: of
    `group_size` inputs, or the largest group that divides a layer's inputs (small test
    models)."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        weight = empty_param(
            sum(output_sizes), input_size, dtype=params_dtype, output_dim=0, input_dim=1
        )
        layer.register_parameter("weight", weight)
        fitting = [g for g in WOQ_GROUP_SIZES if g <= self.group_size and input_size % g == 0]
        if not fitting:
            raise ValueError(f"{layer.prefix}: {input_size} inputs make no int4 groups")
        layer.woq_group_size = max(fitting)

    def prepare(self, layer):
        parts = woq_quantize_rtn(layer.weight.data, self.bits, layer.woq_group_size)
        del layer.weight
        store_woq(layer, *parts)

    def process_weights_after_loading(self, layer):
        self.prepare(layer)

    def apply(self, layer, x, bias=None):
        return kernels.woq_linear(
            x, layer.qweight, layer.scales, layer.mins, self.bits, layer.woq_group_size, bias
        )


def _register_zeros_and_scales(
    layer, input_size: int, out: int, group: int, zeros_per_word: int
) -> None:
    """AWQ's and GPTQ's `qzeros` int32 [K/G, N/zeros_per_word] and `scales` fp16 [K/G, N],
    one row per group of inputs."""
    layer.register_parameter(
        "qzeros",
        empty_param(
            input_size // group,
            out // zeros_per_word,
            dtype=torch.int32,
            input_dim=0,
            input_pack=group,
            output_dim=1,
            output_pack=zeros_per_word,
        ),
    )
    layer.register_parameter(
        "scales",
        empty_param(
            input_size // group,
            out,
            dtype=torch.float16,
            input_dim=0,
            input_pack=group,
            output_dim=1,
        ),
    )


class AwqLinearMethod(WoqLinearMethod):
    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        out, group = sum(output_sizes), self.group_size
        int32 = torch.int32
        layer.register_parameter(
            "qweight",
            empty_param(
                input_size, out // 8, dtype=int32, input_dim=0, output_dim=1, output_pack=8
            ),
        )
        _register_zeros_and_scales(layer, input_size, out, group, zeros_per_word=8)

    def prepare(self, layer):
        parts = awq_to_woq(
            layer.qweight.data, layer.qzeros.data, layer.scales.data, self.group_size
        )
        del layer.qzeros
        store_woq(layer, *parts)


class GptqLinearMethod(WoqLinearMethod):
    def __init__(self, bits: int, group_size: int, zeros_stored_minus_one: bool, name: str):
        super().__init__(bits, group_size, name)
        self.zeros_stored_minus_one = zeros_stored_minus_one

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        out, group, per_word = sum(output_sizes), self.group_size, 32 // self.bits
        int32 = torch.int32
        layer.register_parameter(
            "qweight",
            empty_param(
                input_size // per_word,
                out,
                dtype=int32,
                input_dim=0,
                input_pack=per_word,
                output_dim=1,
            ),
        )
        _register_zeros_and_scales(layer, input_size, out, group, zeros_per_word=per_word)
        # Each fused shard loads its own g_idx; they share the layer's input, so activation
        # order gives them the same one (checked on loading).
        layer.register_parameter(
            "g_idx", empty_param(input_size, dtype=int32, input_dim=0, combine="same")
        )

    def prepare(self, layer):
        row_parallel = isinstance(layer, RowParallelLinear)
        g_idx = layer.g_idx.data
        if row_parallel:  # this rank's inputs: its groups counted from its first one
            g_idx = g_idx - layer.tp_rank * (layer.input_size // self.group_size)
            plain = torch.arange(layer.input_size, device=g_idx.device) // self.group_size
            if layer.tp_size > 1 and not torch.equal(g_idx.long(), plain):
                raise ValueError(
                    f"{layer.prefix}: an activation-order GPTQ checkpoint (desc_act) cannot "
                    "split its inputs between tensor-parallel ranks; use tensor_parallel_size=1 "
                    "or a checkpoint quantized with desc_act=false"
                )
        qweight, scales, mins, perm = gptq_to_woq(
            layer.qweight.data,
            layer.qzeros.data,
            layer.scales.data,
            g_idx,
            self.group_size,
            self.bits,
            self.zeros_stored_minus_one,
        )
        del layer.qzeros, layer.g_idx
        store_woq(layer, qweight, scales, mins)
        if perm is not None:
            layer.register_buffer("input_perm", perm.to(torch.int64))

    def apply(self, layer, x, bias=None):
        perm = getattr(layer, "input_perm", None)
        if perm is not None:
            x = x.index_select(-1, perm)
        return super().apply(layer, x, bias)


def _group_size(stored: dict, method: str) -> int:
    group = int(stored.get("group_size", 128))
    if group not in WOQ_GROUP_SIZES:
        raise ValueError(
            f"{method} quantization_config.group_size={group} is not supported; the kernels "
            f"take groups of {', '.join(map(str, WOQ_GROUP_SIZES))} inputs"
        )
    return group


class _Int4Config(QuantConfig):
    def __init__(self, method: LinearMethod, ignored: list[str]):
        self.method = method
        self.ignored = ignored

    def linear_method(self, prefix: str, shards: list[str]) -> LinearMethod:
        if any(part in shard for shard in shards for part in self.ignored):
            return UNQUANTIZED
        return self.method


class AwqConfig(_Int4Config):
    """quant_method "awq" (bits 4, zero_point true, version "gemm"); none: dummy weights."""

    name = "awq"

    @classmethod
    def create(cls, hf_config: Any, model: str | None, device) -> AwqConfig:
        stored = getattr(hf_config, "quantization_config", None)
        if stored is None:
            return cls(_OnlineInt4(4, 128, "awq"), [])
        bits = int(stored.get("bits", stored.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"awq quantization_config.bits={bits}: AWQ runs 4 bits")
        if not stored.get("zero_point", True):
            raise ValueError("awq quantization_config.zero_point=false is not supported")
        version = str(stored.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"awq quantization_config.version={version!r}: only the gemm packing loads"
            )
        group = _group_size(
            {"group_size": stored.get("group_size", stored.get("q_group_size"))}, "awq"
        )
        return cls(
            AwqLinearMethod(4, group, "awq"), list(stored.get("modules_to_not_convert") or [])
        )


class GptqConfig(_Int4Config):
    """quant_method "gptq" (bits 4 or 8; checkpoint_format "gptq" stores zero points minus
    one, "gptq_v2" as they are); none: dummy weights."""

    name = "gptq"

    @classmethod
    def create(cls, hf_config: Any, model: str | None, device) -> GptqConfig:
        stored = getattr(hf_config, "quantization_config", None)
        if stored is None:
            return cls(_OnlineInt4(4, 128, "gptq"), [])
        bits = int(stored.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"gptq quantization_config.bits={bits}: the kernels run 4 or 8 bits")
        group = _group_size(stored, "gptq")
        fmt = str(stored.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq quantization_config.checkpoint_format={fmt!r} is not supported")
        method = GptqLinearMethod(bits, group, fmt == "gptq", "gptq")
        return cls(method, list(stored.get("modules_to_not_convert") or []))
