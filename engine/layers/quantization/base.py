"""What a quantization method is to a linear layer, and the unquantized method.

A `LinearMethod` decides which parameters a linear layer holds, how they are prepared once
loaded, and how the layer multiplies. The parallel layers (engine/layers/linear.py) load
every parameter through one sharding rule, read from attributes the method sets with
`shard_dims`:

    output_dim / input_dim    the tensor dim indexing output / input features (None: none)
    output_pack / input_pack  features per element along that dim (8 for int4 packed in
                              int32, the group size for group scales, 128 for block scales)
    combine="max"             a replicated scalar loaded once per fused shard keeps the
                              largest (a static activation scale shared by q, k and v)
    combine="same"            a tensor every fused shard carries alike (GPTQ's g_idx): the
                              later shards must equal the first
    output_repeat=r           each checkpoint row stands for r output features (block
                              scales of 128 rows): rows are repeated r times on loading,
                              so that shards which start inside a block load exactly

A checkpoint tensor of one element for a parameter with an output_dim fills the loading
shard's output range: a per-tensor scale of q, k or v becomes per-channel, exactly.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels


def shard_dims(
    param: nn.Parameter,
    *,
    output_dim: int | None = None,
    input_dim: int | None = None,
    output_pack: int = 1,
    input_pack: int = 1,
    combine: str | None = None,
    output_repeat: int = 1,
) -> nn.Parameter:
    """Marks how `param` is cut between tensor-parallel ranks (see the module doc)."""
    param.output_repeat = output_repeat
    param.output_dim = output_dim
    param.input_dim = input_dim
    param.output_pack = output_pack
    param.input_pack = input_pack
    param.combine = combine
    return param


def empty_param(*shape: int, dtype: torch.dtype | None = None, **dims) -> nn.Parameter:
    """An uninitialised frozen parameter with its sharding attributes."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    return shard_dims(param, **dims)


def replace_param(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Swap a loaded parameter for its prepared form (a new dtype or shape) after loading."""
    delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


class LinearMethod:
    """How one linear layer's weights are created, loaded and multiplied."""

    name = "none"

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        """Register the layer's parameters. input_size: this rank's input features;
        output_sizes: this rank's output features of each fused shard ([q, k, v] or
        [gate, up]; one entry for an unfused layer)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded checkpoint tensors into what `apply` reads (once, after loading)."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype."""
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """16- or 32-bit weight [out, in]; kernels.linear (the Triton GEMV at batch 1)."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        weight = empty_param(
            sum(output_sizes), input_size, dtype=params_dtype, output_dim=0, input_dim=1
        )
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias=None):
        return kernels.linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()


class QuantConfig:
    """One model's quantization: which method each linear layer gets."""

    name = "none"
    """What runs, for logs and /v1/models ("fp8", "awq", ...)."""

    @classmethod
    def create(cls, hf_config, model: str | None, device: torch.device) -> QuantConfig:
        """From the checkpoint's quantization_config (none: quantize at load); ValueError
        naming `quantization` when the device cannot run it."""
        raise NotImplementedError

    def linear_method(self, prefix: str, shards: list[str]) -> LinearMethod:
        """The method of the linear layer `prefix` ("model.layers.3.self_attn.qkv_proj"),
        whose checkpoint tensors come from the modules `shards` (["...q_proj", "...k_proj",
        "...v_proj"]; [prefix] for an unfused layer)."""
        raise NotImplementedError

    def gguf_weights(self, path, hf_config):
        """The (name, tensor) pairs a GGUF file feeds this config's layers; None: the
        dequantized float tensors."""
        return None


def require_fp8(device: torch.device | str, key: str) -> None:
    """ValueError naming `key` on a GPU without float8 arithmetic (before Ada / Hopper)."""
    device = torch.device(device)
    if device.type != "cuda":
        return  # the torch references run fp8 on a CPU
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"{key}='fp8' needs a GPU with float8 support (compute capability 8.9 or newer: "
            f"Ada, Hopper, Blackwell); {name} has {capability[0]}.{capability[1]}. Use a 16-bit "
            "model, or an int4 (awq / gptq) checkpoint"
        )
