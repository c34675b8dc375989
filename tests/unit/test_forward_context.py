"""The forward context: one per thread, never nested."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.forward_context import AttentionMetadata, forward_context, get_attention_metadata


def _meta(n: int) -> AttentionMetadata:
    ids = torch.arange(n)
    return AttentionMetadata(ids, ids.int(), ids.int(), ids.int()[None], n, n)


def test_a_nested_forward_is_refused_and_the_context_ends_with_its_block():
    with forward_context(_meta(2)):
        with pytest.raises(RuntimeError, match="already active"):
            with forward_context(_meta(3)):
                pass
    with pytest.raises(RuntimeError, match="no forward_context"):
        get_attention_metadata()


def test_two_threads_run_forwards_at_once_each_seeing_its_own_batch():
    # Two engines in one process (an offline LLM beside an async engine's loop thread).
    inside, release = threading.Barrier(2), threading.Event()
    seen: dict[int, int] = {}
    errors: list[BaseException] = []

    def forward(n: int) -> None:
        try:
            with forward_context(_meta(n)):
                inside.wait(timeout=5)
                release.wait(timeout=5)
                seen[n] = get_attention_metadata().max_query_len
        except BaseException as error:  # reported below, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=forward, args=(n,)) for n in (2, 5)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(timeout=10)
    assert not errors and seen == {2: 2, 5: 5}
