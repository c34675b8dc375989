"""The static input buffers both CUDA-graph holders replay from, and a step's copy into them.

A captured graph reads fixed addresses, so a step copies its tensors into the first `n` rows
of buffers sized for the largest bucket and pads the bucket's other rows: with a slot of -1
they store nothing. Their input ids and positions keep stale values, which reach no real row
(piecewise_graphs.py says why).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.forward_context import AttentionMetadata


class StaticTokenInputs(Protocol):
    sizes: list[int]
    """The captured buckets, ascending."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor


def static_token_buffers(
    num_tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, positions, slot mapping) for `num_tokens` rows; every slot -1."""
    return (
        torch.zeros(num_tokens, dtype=torch.long, device=device),
        torch.zeros(num_tokens, dtype=torch.long, device=device),
        torch.full((num_tokens,), -1, dtype=torch.long, device=device),
    )


def copy_step_in(
    graphs: StaticTokenInputs,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    extra: Sequence[tuple[torch.Tensor, torch.Tensor, int]] = (),
) -> tuple[int, int]:
    """Copy a step into the static buffers of `graphs`; returns (its rows n, its bucket).

    `extra`: more (static buffer, the step's tensor, the value of rows n up to the bucket).
    A step tensor narrower than its buffer fills the leading columns (a block table)."""
    n = input_ids.shape[0]
    bucket = graphs.sizes[bisect.bisect_left(graphs.sizes, n)]
    copies = [
        (graphs.input_ids, input_ids, None),
        (graphs.positions, positions, None),
        (graphs.slot_mapping, meta.slot_mapping, -1),
        *extra,
    ]
    for static, step, _ in copies:
        leading = (slice(n), *(slice(width) for width in step.shape[1:]))
        static[leading].copy_(step, non_blocking=True)
    if bucket > n:
        for static, _, pad in copies:
            if pad is not None:
                static[n:bucket].fill_(pad)
    return n, bucket
