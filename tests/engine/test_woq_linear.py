"""WoqLinearMethod: the WOQ layout's parameters in a parallel linear layer, multiplied by
kernels.woq_linear; a format that stores other tensors fills the layout in `prepare`."""

from __future__ import annotations

import pytest
import torch

from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from engine.layers.quantization.base import empty_param
from engine.layers.quantization.woq import WoqLinearMethod, store_woq
from kernels.woq_ref import woq_dequantize, woq_quantize_rtn


def _woq(n: int, k: int, bits: int, group: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return woq_quantize_rtn(w, bits, group)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 16)])
def test_a_merged_layer_holds_the_layout_and_multiplies_its_weights(bits, group):
    layer = MergedColumnParallelLinear(
        64, [48, 16], bias=True, method=WoqLinearMethod(bits, group), prefix="gate_up"
    )
    assert layer.qweight.shape == (64, 64 * bits // 8) and layer.qweight.dtype == torch.uint8
    assert layer.scales.shape == layer.mins.shape == (64, 64 // group)
    assert layer.scales.dtype == layer.mins.dtype == torch.float16
    shards = [_woq(48, 64, bits, group, seed=1), _woq(16, 64, bits, group, seed=2)]
    for shard_id, parts in enumerate(shards):
        for name, tensor in zip(("qweight", "scales", "mins"), parts, strict=True):
            layer.weight_loader(getattr(layer, name), tensor, shard_id)
    bias = torch.randn(64)
    layer.weight_loader(layer.bias, bias[:48], 0)
    layer.weight_loader(layer.bias, bias[48:], 1)
    layer.method.process_weights_after_loading(layer)
    w = torch.cat([woq_dequantize(*parts, bits, group) for parts in shards])
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), x @ w.T + bias)


class OnlineRtn(WoqLinearMethod):
    """A format that loads float weights and quantizes them at load (as dummy weights of
    awq / gptq do): its own parameter in create_weights, the layout filled in prepare."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        weight = empty_param(
            sum(output_sizes), input_size, dtype=params_dtype, output_dim=0, input_dim=1
        )
        layer.register_parameter("weight", weight)

    def prepare(self, layer):
        store_woq(layer, *woq_quantize_rtn(layer.weight.data, self.bits, self.group_size))
        del layer.weight


def test_prepare_fills_the_layout_from_a_formats_own_tensors():
    layer = RowParallelLinear(128, 8, method=OnlineRtn(4, 64), prefix="down")
    w = torch.randn(8, 128)
    layer.weight_loader(layer.weight, w)
    layer.method.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight") and layer.qweight.shape == (8, 64)
    x = torch.randn(3, 128)
    expected = x @ woq_dequantize(*woq_quantize_rtn(w, 4, 64), 4, 64).T
    torch.testing.assert_close(layer(x), expected)


def test_bad_formats_and_layouts_are_named():
    with pytest.raises(ValueError, match="bits must be one of"):
        WoqLinearMethod(3, 32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        WoqLinearMethod(4, 256)
    layer = RowParallelLinear(64, 8, method=WoqLinearMethod(4, 32), prefix="model.o_proj")
    store_woq(layer, torch.zeros(8, 32, dtype=torch.uint8), *[torch.zeros(8, 2)] * 2)
    with pytest.raises(ValueError, match=r"model\.o_proj: scales must be float16"):
        layer.method.process_weights_after_loading(layer)
