"""Weight-only quantized (WOQ) linear layers: the one method of every format that stores a
layer as small integers with a scale and a min per group of inputs (GGUF, AWQ, GPTQ).

The layout (kernels/woq_ref.py defines it) for N output and K input features:

    qweight  uint8 [N, K * bits // 8]   bits 4: two values a byte, the even input low
    scales   float16 [N, K // G]        w[n, k] = q[n, k] * scales[n, k // G]
    mins     float16 [N, K // G]                  + mins[n, k // G]

Rows are output channels, so column-parallel ranks cut rows and row-parallel ranks cut
columns: whole bytes of qweight (input_pack 8 // bits) and whole groups of the scales and
mins (input_pack G); a rank whose inputs split a group is refused by the linear layer,
naming it. A format whose checkpoint holds other tensors (AWQ's int32 words and zeros)
registers those in its own `create_weights` and turns them into the layout in `prepare`,
storing the result with `store_woq`.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.layers.quantization.base import LinearMethod, empty_param, replace_param
from kernels.woq_ref import WOQ_BITS, WOQ_GROUP_SIZES, check_woq

WOQ_PARAMS = ("qweight", "scales", "mins")


def store_woq(
    layer: nn.Module, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> None:
    """Put a layer's weight in the layout (replacing any parameter of those names)."""
    for name, tensor in zip(WOQ_PARAMS, (qweight, scales, mins)):
        if hasattr(layer, name):
            replace_param(layer, name, tensor)
        else:
            layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


class WoqLinearMethod(LinearMethod):
    """A layer held as `qweight`, `scales` and `mins` at `bits` (4 or 8) with `group_size`
    inputs a group (16, 32, 64 or 128), multiplied by kernels.woq_linear. `name` is the
    format's, for logs and errors."""

    name = "woq"

    def __init__(self, bits: int, group_size: int, name: str | None = None):
        if bits not in WOQ_BITS:
            raise ValueError(f"bits must be one of {WOQ_BITS}, got {bits}")
        if group_size not in WOQ_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {WOQ_GROUP_SIZES}, got {group_size}")
        self.bits = bits
        self.group_size = group_size
        if name is not None:
            self.name = name

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        out = sum(output_sizes)
        per_byte = 8 // self.bits
        # Rounded up: a rank whose inputs split a byte or a group is refused by the layer's
        # pack check, which names it; these shapes only have to exist until then.
        qweight = empty_param(
            out,
            -(-input_size // per_byte),
            dtype=torch.uint8,
            output_dim=0,
            input_dim=1,
            input_pack=per_byte,
        )
        layer.register_parameter("qweight", qweight)
        for name in ("scales", "mins"):
            param = empty_param(
                out,
                -(-input_size // self.group_size),
                dtype=torch.float16,
                output_dim=0,
                input_dim=1,
                input_pack=self.group_size,
            )
            layer.register_parameter(name, param)

    def prepare(self, layer: nn.Module) -> None:
        """Turn the loaded checkpoint tensors into the layout (`store_woq`). Tensors loaded
        in the layout (GGUF's, repacked while reading the file) need nothing."""

    def process_weights_after_loading(self, layer):
        self.prepare(layer)
        try:
            check_woq(layer.qweight, layer.scales, layer.mins, self.bits, self.group_size)
        except ValueError as e:
            raise ValueError(f"{getattr(layer, 'prefix', 'layer')}: {e}") from None

    def apply(self, layer, x, bias=None):
        return kernels.woq_linear(
            x, layer.qweight, layer.scales, layer.mins, self.bits, self.group_size, bias
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bits={self.bits}, group_size={self.group_size})"
