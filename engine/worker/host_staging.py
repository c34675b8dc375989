"""Per-step host arrays to the device, and results back, without making the host wait.

A copy from pageable host memory waits for everything queued before it on the stream, so
with a step in flight it would stall the host until that step ends. Copies from pinned
memory are asynchronous. Two pinned buffers alternate between steps: a step writes one
while the copies of the step before may still be queued from the other.
"""

from __future__ import annotations

import numpy as np
import torch

_BUFFER_BYTES = 8 << 20


class HostToDevice:
    def __init__(self, device: torch.device):
        self.device = device
        self._buffers = []
        if device.type == "cuda":
            self._buffers = [
                torch.empty(_BUFFER_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            ]
        self._current = 0
        self._offset = 0

    def next_step(self) -> None:
        self._current ^= 1
        self._offset = 0

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        source = torch.from_numpy(np.ascontiguousarray(array))
        if not self._buffers:
            return source.to(self.device)
        start = -(-self._offset // 8) * 8
        end = start + source.numel() * source.element_size()
        if end > _BUFFER_BYTES:
            return source.pin_memory().to(self.device, non_blocking=True)
        self._offset = end
        staged = self._buffers[self._current][start:end].view(source.dtype).view(source.shape)
        staged.copy_(source)
        return staged.to(self.device, non_blocking=True)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting: through pinned memory on a GPU."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, queued on the stream without waiting for it
    (synchronize the stream, or an event recorded after this, before reading). Host tensors
    are returned as they are."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
