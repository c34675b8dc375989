"""Parallel state and the only collectives the model uses.

Ranks are laid out with tensor-parallel ranks contiguous, as in vLLM:
rank = pp_rank * tp_size + tp_rank. Every collective is the identity when its group has one
rank, so single-device runs never touch torch.distributed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

import kvray_env

logger = logging.getLogger(__name__)

SYMMETRIC_ALL_REDUCE_MAX_BYTES = 2 << 20
"""Largest all-reduce that takes the one-shot peer-memory path; larger ones go to NCCL."""


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None


_state = ParallelState()
_symmetric: SymmetricAllReduce | None = None
_sequence_parallel_min_tokens: int | None = None


def get_tp_rank() -> int:
    return _state.tp_rank


def get_tp_size() -> int:
    return _state.tp_size


def get_pp_rank() -> int:
    return _state.pp_rank


def get_pp_size() -> int:
    return _state.pp_size


def get_pp_layer_range(num_layers: int) -> tuple[int, int]:
    """[start, end) of the decoder layers this pipeline stage owns; earlier stages take the remainder."""
    size, rank = _state.pp_size, _state.pp_rank
    if num_layers < size:
        raise ValueError(
            f"num_hidden_layers={num_layers} is smaller than pipeline_parallel_size={size}"
        )
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def divide(numerator: int, denominator: int, what: str, by: str = "tensor_parallel_size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by {by}={denominator}")
    return numerator // denominator


def check_parallel_sizes(hf_config, tp_size: int, pp_size: int) -> None:
    """Refuse, before any rank starts, sizes that the model's layers cannot be split into."""
    num_heads = hf_config.num_attention_heads
    divide(num_heads, tp_size, "num_attention_heads")
    divide(
        getattr(hf_config, "num_key_value_heads", None) or num_heads, tp_size, "num_key_value_heads"
    )
    divide(hf_config.intermediate_size, tp_size, "intermediate_size")
    if hf_config.num_hidden_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} must be <= num_hidden_layers="
            f"{hf_config.num_hidden_layers}"
        )


def init_distributed(
    tp_size: int,
    pp_size: int,
    rank: int,
    backend: str | None = None,
    init_method: str = "env://",
) -> None:
    """Join the world of tp_size * pp_size ranks and build the TP and PP groups.

    backend None picks NCCL when CUDA is available, gloo otherwise.
    """
    global _state
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"tp_size and pp_size must be >= 1, got {tp_size} and {pp_size}")
    world_size = tp_size * pp_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank)
    tp_group = pp_group = None
    if world_size > 1:
        # new_group is collective: every rank creates every group, keeping its own.
        for pp in range(pp_size):
            group = dist.new_group([pp * tp_size + t for t in range(tp_size)])
            if pp == rank // tp_size:
                tp_group = group
        for tp in range(tp_size):
            group = dist.new_group([p * tp_size + tp for p in range(pp_size)])
            if tp == rank % tp_size:
                pp_group = group
    _state = ParallelState(
        tp_rank=rank % tp_size,
        tp_size=tp_size,
        pp_rank=rank // tp_size,
        pp_size=pp_size,
        tp_group=tp_group,
        pp_group=pp_group,
    )


def destroy_distributed() -> None:
    global _state, _symmetric, _sequence_parallel_min_tokens
    _symmetric = None
    _sequence_parallel_min_tokens = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()


@contextmanager
def override_parallel_state(
    tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1
) -> Iterator[None]:
    """Pretend to be one rank of a larger world without process groups.

    For building a rank's shard of a model in tests and tools; collectives across more than
    one rank fail inside it.
    """
    global _state
    saved = _state
    _state = ParallelState(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
    try:
        yield
    finally:
        _state = saved


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _state.tp_size == 1:
        return x
    if _symmetric is not None and _symmetric.fits(x):
        return _symmetric.all_reduce(x)
    dist.all_reduce(x, group=_tp_group())
    return x


class SymmetricAllReduce:
    """Sum over the tensor-parallel group by reading every peer's buffer directly (NVLink).

    One kernel copies the local input into this rank's symmetric buffer, waits for the
    peers at a barrier and adds all their buffers: a few microseconds for the small tensors
    of a decode step, where an NCCL all-reduce takes several times that. CUDA-graph safe;
    every rank must run the same sequence of all-reduces, as tensor-parallel ranks do.
    """

    DTYPES = (torch.bfloat16, torch.float32)

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in self.DTYPES
            and x.is_contiguous()
            and nbytes <= self.max_bytes
            and nbytes % 16 == 0
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        staging = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            staging, x, "sum", self.group_name, out
        )


def init_symmetric_all_reduce(
    device: torch.device, max_bytes: int = SYMMETRIC_ALL_REDUCE_MAX_BYTES
) -> bool:
    """Set up the peer-memory all-reduce for this rank's tensor-parallel group.

    Collective over the group: call on every rank after its CUDA device is set. Falls back
    to NCCL (returns False) when the GPUs cannot map each other's memory, when a rank sees
    only its own GPU, or with the switch `kvray_env.NCCL_ONLY` on.
    """
    global _symmetric
    if _state.tp_size == 1 or device.type != "cuda" or kvray_env.nccl_only():
        return False
    if torch.cuda.device_count() < _state.tp_size:
        return False  # each rank sees only its own GPU: peers' memory cannot be mapped
    # Only the peer-load kernel is used; a multicast object is never needed.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    try:
        _symmetric = SymmetricAllReduce(_tp_group(), device, max_bytes)
    except Exception as e:  # no NVLink/P2P, no symmetric-memory support in this torch
        logger.warning("peer-memory all-reduce unavailable, using NCCL for all sizes: %s", e)
        _symmetric = None
    # Every rank must take the same path for every all-reduce.
    ok = torch.tensor([_symmetric is not None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=_tp_group())
    if not ok.item():
        _symmetric = None
    elif _state.tp_rank == 0:
        logger.info("tensor-parallel all-reduce: peer memory up to %d bytes, NCCL above", max_bytes)
    return _symmetric is not None


SEQUENCE_PARALLEL_MIN_TOKENS = 2048
"""Smallest batch that runs sequence-parallel by default where peer memory is up."""

# torch 2.13 renamed these two; the arguments are the same.
_all_gather_rows = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_rows = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def init_sequence_parallel(min_tokens: int | None) -> None:
    """Run batches of at least `min_tokens` tokens sequence-parallel (None: the default).

    Sequence parallel keeps the residual stream split by rows across the tensor-parallel
    ranks: each row-parallel layer reduce-scatters its partial sums instead of all-reducing
    them, the norms run on a rank's own rows, and each column-parallel layer all-gathers
    its input. With peer memory the gather and the scatter are copies by the copy engines,
    split so that they run under the layer's own GEMM (torch's fused collective matmuls),
    where an NCCL all-reduce of a large batch stalls the GPU. Default: on where peer memory
    is up, from SEQUENCE_PARALLEL_MIN_TOKENS; off otherwise. 0 turns it off. Call on every
    rank with the same value after `init_symmetric_all_reduce`.
    """
    global _sequence_parallel_min_tokens
    if min_tokens is None:
        min_tokens = SEQUENCE_PARALLEL_MIN_TOKENS if _symmetric is not None else 0
    _sequence_parallel_min_tokens = min_tokens if min_tokens > 0 and _state.tp_size > 1 else None


def sequence_parallel_enabled(num_tokens: int) -> bool:
    """Whether a forward pass of `num_tokens` tokens runs sequence-parallel.

    Never inside a CUDA graph capture: graphs hold decode batches, which all-reduce.
    """
    return (
        _sequence_parallel_min_tokens is not None
        and num_tokens >= _sequence_parallel_min_tokens
        and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    )


def sequence_shard(x: torch.Tensor) -> torch.Tensor:
    """This rank's rows of x [T, ...]: T padded with zero rows to a multiple of the TP size."""
    padded = _pad_rows(x, _state.tp_size)
    rows = padded.shape[0] // _state.tp_size
    return padded[_state.tp_rank * rows : (_state.tp_rank + 1) * rows]


def sequence_gather(x_shard: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Every rank's rows of a sequence-parallel tensor, in order, cut back to num_tokens."""
    out = x_shard.new_empty(x_shard.shape[0] * _state.tp_size, *x_shard.shape[1:])
    _all_gather_rows(out, x_shard.contiguous(), group=_tp_group())
    return out[:num_tokens]


def all_gather_linear(
    x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_tokens: int
) -> torch.Tensor:
    """linear(sequence_gather(x_shard), weight, bias) [num_tokens, out], the gather under the GEMM."""
    if _symmetric is not None:
        _, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(
            x_shard.contiguous(), [weight.t()], 0, _symmetric.group_name, return_A=False
        )
        y = y[:num_tokens]
        return y + bias if bias is not None else y
    return torch.nn.functional.linear(sequence_gather(x_shard, num_tokens), weight, bias)


def linear_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """sequence_shard of linear(x, weight) summed over the TP ranks, plus bias once."""
    if _symmetric is not None:
        y = torch.ops.symm_mem.fused_matmul_reduce_scatter(
            _pad_rows(x, _state.tp_size), weight.t(), "sum", 0, _symmetric.group_name
        )
    else:
        y = sequence_reduce_scatter(torch.nn.functional.linear(x, weight))
    return y + bias if bias is not None else y


def sequence_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """sequence_shard of x [T, ...] summed over the TP ranks."""
    x = _pad_rows(x, _state.tp_size)
    out = x.new_empty(x.shape[0] // _state.tp_size, *x.shape[1:])
    _reduce_scatter_rows(out, x.contiguous(), group=_tp_group())
    return out


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -x.shape[0] % multiple
    if not extra:
        return x
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_tp_group())
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """`x` of tensor-parallel rank `src` into `x` of every rank of the group, in place."""
    if _state.tp_size == 1:
        return x
    dist.broadcast(x, group=_tp_group(), group_src=src)
    return x


def send_intermediate_tensors(tensors: dict[str, torch.Tensor]) -> None:
    """Send a stage's hand-off to the same tensor-parallel rank of the next stage.

    Keys go in sorted order; `recv_intermediate_tensors` on the next stage reads them in the
    same order.
    """
    dst = _state.pp_rank + 1
    if dst >= _state.pp_size:
        raise RuntimeError("the last pipeline stage has no next stage to send to")
    for key in sorted(tensors):
        dist.send(tensors[key].contiguous(), group=_pp_group(), group_dst=dst)


def recv_intermediate_tensors(
    keys: list[str], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Receive the previous stage's hand-off: one tensor of `shape` per key."""
    src = _state.pp_rank - 1
    if src < 0:
        raise RuntimeError("the first pipeline stage has no previous stage to receive from")
    out = {}
    for key in sorted(keys):
        out[key] = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out[key], group=_pp_group(), group_src=src)
    return out


def _pp_group() -> dist.ProcessGroup:
    if _state.pp_group is None:
        raise RuntimeError(
            f"pipeline_parallel_size={_state.pp_size} but no process group: call init_distributed()"
        )
    return _state.pp_group


def get_tp_group() -> dist.ProcessGroup:
    """This rank's tensor-parallel process group (after init_distributed)."""
    return _tp_group()


def get_symmetric_all_reduce() -> SymmetricAllReduce | None:
    """The peer-memory all-reduce, when init_symmetric_all_reduce set one up."""
    return _symmetric


def _tp_group() -> dist.ProcessGroup:
    if _state.tp_group is None:
        raise RuntimeError(
            f"tensor_parallel_size={_state.tp_size} but no process group: call init_distributed()"
        )
    return _state.tp_group
