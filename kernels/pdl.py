"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still
running (its last wave), instead of after it has drained. The rule that keeps this safe:
every such kernel calls `wait_for_previous_kernel` in every program before it reads
anything an earlier kernel wrote or writes anything at all; that wait returns once the
previous kernel is complete and its memory visible. Only after its own wait does a kernel
let the next one launch, so "kernel N complete" still implies "kernel N-1 complete" along
the whole chain. Work before the wait overlaps the previous kernel's tail: the GEMV loads
its first weight tile there (weights are never written).

Kernels that are not Triton's (cuBLAS, NCCL, torch) launch as usual and wait in full.
The switch `kvray_env.PDL` turns it off (for comparison runs).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

import kvray_env


@functools.cache
def _supported(device_index: int) -> bool:
    if not kvray_env.pdl():
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(t: torch.Tensor) -> dict[str, bool]:
    """Launch options for a kernel on t's device: `kernel[grid](..., **pdl_launch(t))`.
    The launch attribute and the kernel's USE_PDL wait always go together: a kernel
    launched with PDL that did not wait would race the one before it."""
    on = t.is_cuda and _supported(t.device.index or 0)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
