"""The weight cache (engine/worker/weight_cache.py): least recently used entries go first, an
entry larger than the cache is not kept, a checkpoint rewritten in place is another key; and
a model's weights copied, checked, released and allocated again (weight_tensors.py)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from engine.worker.loader import ModelSource
from engine.worker.weight_cache import WeightCache, WeightKey, checkpoint_fingerprint
from engine.worker.weight_tensors import (
    check_same_shapes,
    copy_into,
    host_copy,
    reallocate,
    release,
    weight_tensors,
)


def _key(path: str) -> WeightKey:
    return WeightKey("hf", path, (), "torch.float32", "none", (0, 1, 0, 1))


def _entry(num_floats: int) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(num_floats)}


def test_least_recently_used_entries_go_first():
    cache = WeightCache(capacity_bytes=3 * 400)
    for name in "abc":
        assert cache.put(_key(name), _entry(100))
    assert cache.get(_key("a")) is not None  # a is now the most recently used
    assert cache.put(_key("d"), _entry(100))
    assert [k.path for k in cache._entries] == ["c", "a", "d"]
    assert cache.used_bytes == 1200
    cache.resize(400)
    assert [k.path for k in cache._entries] == ["d"]


def test_an_entry_larger_than_the_cache_is_not_kept_and_zero_keeps_nothing():
    cache = WeightCache(capacity_bytes=400)
    assert not cache.put(_key("big"), _entry(101))
    assert cache.get(_key("big")) is None
    assert not WeightCache(0).put(_key("a"), _entry(1))


def test_a_checkpoint_rewritten_in_place_has_another_fingerprint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    source = ModelSource("hf", str(tmp_path))
    before = checkpoint_fingerprint(source, seed=0)
    os.utime(weights, ns=(1, 1))
    assert checkpoint_fingerprint(source, seed=0) != before
    assert checkpoint_fingerprint(ModelSource("dummy", "tiny-llama"), seed=1) == ("seed", 1)


def test_weights_are_checked_before_anything_is_copied_and_come_back_after_a_release():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    live = weight_tensors(model)
    saved = host_copy(live, pin=False)
    other = {k: v + 1 for k, v in saved.items()}
    wrong = dict(other) | {"1.weight": torch.zeros(2, 4)}
    with pytest.raises(ValueError, match=r"'1.weight'.*\(2, 4\).*\(2, 3\)"):
        copy_into(live, wrong)
    assert all(torch.equal(live[k], saved[k]) for k in live)  # nothing copied
    with pytest.raises(ValueError, match="no tensor '0.bias'"):
        check_same_shapes(live, {k: v for k, v in other.items() if k != "0.bias"})
    copy_into(live, other)
    assert all(torch.equal(live[k], other[k]) for k in live)
    specs = release(live)
    assert all(p.numel() == 0 for p in model.parameters())
    reallocate(live, specs)
    copy_into(live, saved)
    assert torch.equal(model[0].weight, saved["0.weight"])


def test_weight_cache_gb_beyond_the_hosts_memory_is_refused_naming_it():
    from engine.config import check_weight_cache

    check_weight_cache(10, 4, 2, total=100 * 2**30)
    with pytest.raises(ValueError, match=r"weight_cache_gb=30 GiB.*x 2 rank\(s\) = 68.0 GiB"):
        check_weight_cache(30, 4, 2, total=90 * 2**30)
