"""A model's weight tensors as one name -> tensor map: copied to the host, checked against
another set, copied into in place (the tensors keep their addresses, so captured CUDA graphs
stay valid), released and allocated again (new addresses: graphs must be captured again).

The weights are the model's parameters (a tied one once) and the buffers that take checkpoint
tensors (those with a weight_loader: the KV cache scales). Other buffers (rotary tables) are
computed from the config and stay where they are.
"""

from __future__ import annotations

import torch
from torch import nn

TensorSpec = tuple[torch.Size, torch.dtype]


def weight_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors |= {n: b for n, b in model.named_buffers() if hasattr(b, "weight_loader")}
    return tensors


def tensors_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


ALIGN_BYTES = 256


def host_copy(tensors: dict[str, torch.Tensor], pin: bool) -> dict[str, torch.Tensor]:
    """Host copies of `tensors`. With `pin`: views of one pinned buffer (torch's pinned
    allocator rounds each allocation up to a power of two: one buffer wastes that once, and
    one cudaHostAlloc is much faster than hundreds), so copies from and to a GPU run at full
    speed without a wait each."""
    if not pin:
        return {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
    offsets, total = [], 0
    for tensor in tensors.values():
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGN_BYTES) * ALIGN_BYTES
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    copies = {}
    for (name, tensor), offset in zip(tensors.items(), offsets):
        size = tensor.numel() * tensor.element_size()
        view = buffer[offset : offset + size].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.detach(), non_blocking=True)
        copies[name] = view
    torch.cuda.synchronize()
    return copies


def check_same_shapes(live: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """ValueError naming the first tensor of `live` that `new` lacks or holds in another
    shape or dtype (nothing is copied before every tensor has passed)."""
    for name, tensor in live.items():
        other = new.get(name)
        if other is None:
            raise ValueError(f"the new weights have no tensor {name!r}")
        if other.shape != tensor.shape or other.dtype != tensor.dtype:
            raise ValueError(
                f"weight {name!r}: the new weights' shape {tuple(other.shape)} "
                f"({str(other.dtype).removeprefix('torch.')}) does not match the model's "
                f"{tuple(tensor.shape)} ({str(tensor.dtype).removeprefix('torch.')})"
            )


@torch.no_grad()
def copy_into(live: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """Copy `new` into the `live` tensors in place (checked first: check_same_shapes)."""
    check_same_shapes(live, new)
    device = None
    for name, tensor in live.items():
        source = new[name]
        tensor.data.copy_(source, non_blocking=source.is_pinned())
        device = tensor.device
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def release(tensors: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """Free every tensor's memory (each keeps its object, emptied); returns their specs for
    `reallocate`."""
    specs = {}
    for name, tensor in tensors.items():
        specs[name] = (tensor.shape, tensor.dtype)
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return specs


def reallocate(tensors: dict[str, torch.Tensor], specs: dict[str, TensorSpec]) -> None:
    """Give every released tensor memory of its old shape again (contents undefined)."""
    for name, tensor in tensors.items():
        shape, dtype = specs[name]
        tensor.data = torch.empty(shape, dtype=dtype, device=tensor.device)
