"""Tensor-parallel linear layers.

Layers are built from total (unsharded) sizes and keep this rank's slice. What a layer holds
and how it multiplies is its quantization method's (engine/layers/quantization); every
parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which takes the full
checkpoint tensor and copies this rank's part of it, cutting along the dims the method marked.

    ColumnParallelLinear   output features sharded   output stays sharded
    RowParallelLinear      input features sharded    partial sums all-reduced in forward
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import (
    all_gather_linear,
    divide,
    get_tp_rank,
    get_tp_size,
    linear_reduce_scatter,
    sequence_gather,
    sequence_reduce_scatter,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from engine.layers.quantization.base import UNQUANTIZED, LinearMethod, shard_dims


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


def expand_rows(param: nn.Parameter, loaded: torch.Tensor, features: int) -> torch.Tensor:
    """A checkpoint tensor whose rows each stand for `output_repeat` output features, as
    one row per feature (the first `features`); others pass through."""
    repeat = param.output_repeat
    if repeat == 1 or loaded.numel() == 1:
        return loaded
    dim = param.output_dim
    rows = -(-features // repeat)
    if loaded.shape[dim] != rows:
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} has {loaded.shape[dim]} rows of "
            f"{repeat} features in dim {dim}, expected {rows} for {features} features"
        )
    return loaded.repeat_interleave(repeat, dim).narrow(dim, 0, features)


def _load_max(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """A scalar shared by fused shards (a static activation scale) keeps the largest one."""
    if loaded.numel() != 1:
        raise ValueError(f"expected one value, got shape {tuple(loaded.shape)}")
    value = loaded.reshape(param.shape).to(param.dtype)
    param.data.copy_(torch.maximum(param.data, value))


def _load_same(param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
    """A tensor every fused shard carries alike (GPTQ's g_idx): the first one loads, the
    others must equal it."""
    if getattr(param, "loaded_shards", None):
        if not torch.equal(param.data, loaded.to(param.dtype)):
            raise ValueError(
                f"shard {shard_id} differs from shard {param.loaded_shards[0]}; the parts of a "
                "fused layer must share it"
            )
    else:
        default_weight_loader(param, loaded)
    param.loaded_shards = [*getattr(param, "loaded_shards", []), shard_id]


class LinearBase(nn.Module):
    """input_size and output_sizes are this rank's; `method` makes and multiplies the weights."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        method: LinearMethod | None,
        prefix: str,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = sum(output_sizes)
        self.prefix = prefix
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.method = method or UNQUANTIZED
        self.method.create_weights(self, input_size, list(output_sizes), torch.get_default_dtype())
        if bias:
            self.bias = shard_dims(
                nn.Parameter(torch.empty(self.output_size), requires_grad=False), output_dim=0
            )
        else:
            self.register_parameter("bias", None)
        for name, param in self.named_parameters(recurse=False):
            self._check_packs(name, param)
            param.weight_loader = self.weight_loader

    def _check_packs(self, name: str, param: nn.Parameter) -> None:
        if not hasattr(param, "output_pack"):
            raise TypeError(f"{type(self.method).__name__} made {name} without shard_dims")
        if self.tp_size == 1:
            return  # nothing is cut (a checkpoint may end in a partial block)
        for dim, pack, size in (
            (param.output_dim, param.output_pack, self.output_size),
            (param.input_dim, param.input_pack, self.input_size),
        ):
            if dim is not None and size % pack:
                raise ValueError(
                    f"{self.prefix}.{name}: this rank's {size} features do not split into "
                    f"{self.method.name} groups of {pack}; use a tensor_parallel_size that "
                    f"leaves each rank a multiple of {pack}"
                )

    @property
    def quantized(self) -> bool:
        return self.method is not UNQUANTIZED

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        raise NotImplementedError

    def extra_repr(self) -> str:
        quant = f", quantization={self.method.name}" if self.quantized else ""
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}{quant}"


class ColumnParallelLinear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        name: str = "output_size",
        method: LinearMethod | None = None,
        prefix: str = "",
        output_sizes: list[int] | None = None,
    ):
        """output_sizes: the fused shards' total sizes (subclasses); default [output_size]."""
        tp = get_tp_size()
        sizes = output_sizes or [output_size]
        super().__init__(input_size, [divide(s, tp, name) for s in sizes], bias, method, prefix)
        self.gather_output = gather_output

    def shard_range(self, shard_id) -> tuple[int, int]:
        """(offset, size) in this rank's output features of a checkpoint shard."""
        if shard_id is not None:
            raise ValueError(f"an unfused weight takes no shard_id, got {shard_id!r}")
        return 0, self.output_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        if param.combine == "max":
            _load_max(param, loaded_weight)
            return
        if param.combine == "same":
            _load_same(param, loaded_weight, shard_id)
            return
        dim = param.output_dim
        if dim is None:
            default_weight_loader(param, loaded_weight)
            return
        offset, size = self.shard_range(shard_id)
        pack = param.output_pack
        if offset % pack or size % pack:
            raise ValueError(f"shard {shard_id} of {size} features is not a multiple of {pack}")
        target = param.data.narrow(dim, offset // pack, size // pack)
        loaded_weight = expand_rows(param, loaded_weight, size * self.tp_size)
        if loaded_weight.numel() == 1 and param.dim() == 1:
            target.fill_(loaded_weight.reshape(()).to(param.dtype))  # a per-tensor scale
            return
        expected = list(param.shape)
        expected[dim] = size // pack * self.tp_size
        what = f"shard {shard_id}" if shard_id is not None else ""
        check_shape(loaded_weight, expected, what)
        target.copy_(loaded_weight.narrow(dim, self.tp_rank * (size // pack), size // pack))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias)
        return tensor_model_parallel_all_gather(y, dim=-1) if self.gather_output else y

    def forward_gathered(self, x_shard: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Sequence parallel: x_shard is this rank's rows; the output has all num_tokens."""
        if self.gather_output:
            raise ValueError("a sequence-parallel input needs gather_output=False")
        if self.quantized:
            return self.method.apply(self, sequence_gather(x_shard, num_tokens), self.bias)
        return all_gather_linear(x_shard, self.weight, self.bias, num_tokens)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up_proj); shard_id indexes output_sizes."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        method: LinearMethod | None = None,
        prefix: str = "",
    ):
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            name="intermediate_size",
            method=method,
            prefix=prefix,
            output_sizes=self.output_sizes,
        )

    def shard_range(self, shard_id) -> tuple[int, int]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"a merged weight needs a shard_id in 0..{len(self.output_sizes) - 1}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        return offset, self.output_sizes[shard_id] // self.tp_size


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; this rank keeps whole heads: [q | k | v]."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        method: LinearMethod | None = None,
        prefix: str = "",
    ):
        tp = get_tp_size()
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        self.num_kv_heads = divide(total_num_kv_heads, tp, "num_key_value_heads")
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        sizes = [total_num_heads * head_size, *[total_num_kv_heads * head_size] * 2]
        super().__init__(
            hidden_size,
            sum(sizes),
            bias,
            name="num_attention_heads",
            method=method,
            prefix=prefix,
            output_sizes=sizes,
        )

    def shard_range(self, shard_id) -> tuple[int, int]:
        offsets = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}
        if shard_id not in offsets:
            raise ValueError(f"a qkv weight needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        return offsets[shard_id], self.q_size if shard_id == "q" else self.kv_size


class RowParallelLinear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        name: str = "input_size",
        method: LinearMethod | None = None,
        prefix: str = "",
    ):
        super().__init__(
            divide(input_size, get_tp_size(), name), [output_size], bias, method, prefix
        )
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        if param.combine == "max":
            _load_max(param, loaded_weight)
            return
        if param.output_dim is not None:
            loaded_weight = expand_rows(param, loaded_weight, self.output_size)
        dim = param.input_dim
        if dim is None:  # bias, per-output-channel scales: every rank holds them whole
            if loaded_weight.numel() == 1 and param.dim() == 1:
                param.data.fill_(loaded_weight.reshape(()).to(param.dtype))
                return
            default_weight_loader(param, loaded_weight)
            return
        shard = param.shape[dim]
        expected = list(param.shape)
        expected[dim] = shard * self.tp_size
        check_shape(loaded_weight, expected)
        param.data.copy_(loaded_weight.narrow(dim, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every rank holds the whole bias; only rank 0 adds it, so the sum counts it once.
        y = self.method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        return tensor_model_parallel_all_reduce(y) if self.reduce_results else y

    def forward_scattered(self, x: torch.Tensor) -> torch.Tensor:
        """Sequence parallel: the summed output's rows of this rank (engine.distributed.sequence_shard)."""
        if self.quantized:
            y = sequence_reduce_scatter(self.method.apply(self, x))
            return y + self.bias if self.bias is not None else y
        return linear_reduce_scatter(x, self.weight, self.bias)
