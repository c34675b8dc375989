"""Tensor-parallel linear layers.

Layers are built from total (unsharded) sizes and keep this rank's slice. Every parameter
carries `weight_loader(param, loaded_weight, shard_id=None)`, which takes the full
checkpoint tensor and copies this rank's part of it.

    ColumnParallelLinear   weight [out/tp, in]   output stays sharded
    RowParallelLinear      weight [out, in/tp]   partial sums all-reduced in forward
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.distributed import (
    all_gather_linear,
    divide,
    get_tp_rank,
    get_tp_size,
    linear_reduce_scatter,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


def check_shape(
    loaded: torch.Tensor, expected: tuple[int, ...] | torch.Size, what: str = ""
) -> None:
    if tuple(loaded.shape) != tuple(expected):
        part = f" ({what})" if what else ""
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} does not match the expected "
            f"{tuple(expected)}{part}"
        )


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Copy a replicated tensor whole."""
    check_shape(loaded_weight, param.shape)
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}"


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        name: str = "output_size",
    ):
        super().__init__(input_size, divide(output_size, get_tp_size(), name), bias)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        shard = param.shape[0]
        check_shape(loaded_weight, (shard * self.tp_size, *param.shape[1:]))
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = kernels.linear(x, self.weight, self.bias)
        return tensor_model_parallel_all_gather(y, dim=-1) if self.gather_output else y

    def forward_gathered(self, x_shard: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Sequence parallel: x_shard is this rank's rows; the output has all num_tokens."""
        if self.gather_output:
            raise ValueError("a sequence-parallel input needs gather_output=False")
        return all_gather_linear(x_shard, self.weight, self.bias, num_tokens)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up_proj); shard_id indexes output_sizes."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        tp = get_tp_size()
        for size in output_sizes:
            divide(size, tp, "intermediate_size")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        if shard_id is None:
            raise ValueError(f"a merged weight needs a shard_id in 0..{len(self.output_sizes) - 1}")
        full = self.output_sizes[shard_id]
        check_shape(loaded_weight, (full, *param.shape[1:]), f"shard {shard_id}")
        size = full // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; this rank keeps whole heads: [q | k | v]."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ):
        tp = get_tp_size()
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        self.num_kv_heads = divide(total_num_kv_heads, tp, "num_key_value_heads")
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        offsets = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}
        if shard_id not in offsets:
            raise ValueError(f"a qkv weight needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        size = self.q_size if shard_id == "q" else self.kv_size
        check_shape(loaded_weight, (size * self.tp_size, *param.shape[1:]), f"shard {shard_id}")
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offsets[shard_id], size).copy_(shard)


class RowParallelLinear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        name: str = "input_size",
    ):
        super().__init__(divide(input_size, get_tp_size(), name), output_size, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        if param.dim() == 1:
            default_weight_loader(param, loaded_weight)
            return
        shard = param.shape[1]
        check_shape(loaded_weight, (param.shape[0], shard * self.tp_size))
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every rank holds the whole bias; only rank 0 adds it, so the sum counts it once.
        y = kernels.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return tensor_model_parallel_all_reduce(y) if self.reduce_results else y

    def forward_scattered(self, x: torch.Tensor) -> torch.Tensor:
        """Sequence parallel: the summed output's rows of this rank (engine.distributed.sequence_shard)."""
        return linear_reduce_scatter(x, self.weight, self.bias)
