"""Per-batch attention metadata, scoped to one forward pass.

The model runner enters `forward_context(meta)` around `model(...)`; attention layers read
it with `get_attention_metadata()`. Nesting is refused so a stale batch can never leak in.

A forward for piecewise CUDA graphs (engine.worker.piecewise_graphs) passes `split`: attention
layers then hand their paged attention to it instead of running it.

The context belongs to the thread that entered it: two engines in one process (an offline
LLM beside an async engine's loop thread) each run their forwards without seeing the other's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[T] int64: cache slot of each new token (block_id * block_size + offset); -1 = skip."""
    query_start_loc: torch.Tensor
    """[B+1] int32: request i owns query rows query_start_loc[i]:query_start_loc[i+1]."""
    seq_lens: torch.Tensor
    """[B] int32: context length of each request, this step's tokens included."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32: physical block ids of each request, 0-padded (block 0 is null)."""
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0
    """How many requests at the front of the batch have one query token each."""


AttentionSplit = Callable[[Any, torch.Tensor], torch.Tensor]
"""(attention layer, query [T, Hq, D]) -> where the layer's output [T, Hq, D] will be."""


class _ThreadForward(threading.local):
    current: AttentionMetadata | None = None
    split: AttentionSplit | None = None


_state = _ThreadForward()


@contextmanager
def forward_context(
    meta: AttentionMetadata, split: AttentionSplit | None = None
) -> Iterator[AttentionMetadata]:
    state = _state
    if state.current is not None:
        raise RuntimeError("forward_context is already active: nested forward passes")
    state.current, state.split = meta, split
    try:
        yield meta
    finally:
        state.current = state.split = None


def get_attention_metadata() -> AttentionMetadata:
    current = _state.current
    if current is None:
        raise RuntimeError("no forward_context: attention ran outside ModelRunner")
    return current


def get_attention_split() -> AttentionSplit | None:
    return _state.split
