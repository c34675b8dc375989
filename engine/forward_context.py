"""Per-batch attention metadata, scoped to one forward pass.

The model runner enters `forward_context(meta)` around `model(...)`; attention layers read
it with `get_attention_metadata()`. Nesting is refused so a stale batch can never leak in.

While piecewise CUDA graphs are captured (engine.piecewise_graphs), `attention_split(fn)`
hands each attention layer's paged attention to `fn` instead of running it.
"""

from __future__ import annotations

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


_current: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already active: nested forward passes")
    _current = meta
    try:
        yield meta
    finally:
        _current = None


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("no forward_context: attention ran outside ModelRunner")
    return _current


AttentionSplit = Callable[[Any, torch.Tensor], torch.Tensor]
"""(attention layer, query [T, Hq, D]) -> where the layer's output [T, Hq, D] will be."""

_split: AttentionSplit | None = None


@contextmanager
def attention_split(fn: AttentionSplit) -> Iterator[None]:
    global _split
    if _split is not None:
        raise RuntimeError("attention_split is already active")
    _split = fn
    try:
        yield
    finally:
        _split = None


def get_attention_split() -> AttentionSplit | None:
    return _split
