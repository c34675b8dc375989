"""Copy whole KV blocks within each layer's cache: the copy-on-write of forked requests.

The scheduler sends (source, destination) block ids with a step (`blocks_to_copy`); every
rank copies them in its own shard of every layer before the step's forward, on the same
stream, so a copy sees the KV of every step launched before it. One gather and one scatter
over the block dimension per layer: the copies of a step are few (one per fork that writes
into a shared, partial block), and a kernel of its own would not beat two indexed copies.
"""

from __future__ import annotations

import torch

from engine.worker.host_staging import host_to_device


def copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """For each (src, dst): block dst of every cache takes block src's keys and values.

    Each cache is [2, num_blocks, block_size, kv heads, head dim]. Destinations are
    distinct and never a source of the same step (they are blocks fresh from the pool).
    """
    if not pairs or not kv_caches:
        return
    ids = torch.tensor(pairs, dtype=torch.int64)
    device = kv_caches[0].device
    # Through pinned memory: a copy from pageable memory would wait for the step in flight.
    src = host_to_device(ids[:, 0].contiguous(), device)
    dst = host_to_device(ids[:, 1].contiguous(), device)
    for cache in kv_caches:
        # float8 moves as bytes: not every torch build indexes float8 on every device.
        data = cache.view(torch.uint8) if cache.element_size() == 1 else cache
        data.index_copy_(1, dst, data.index_select(1, src))


def copy_blocks_ref(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """The reference: one block at a time."""
    for cache in kv_caches:
        for src, dst in pairs:
            cache[:, dst] = cache[:, src]
