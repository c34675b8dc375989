"""The chained hash that names a full block of tokens in the prefix cache.

A module of its own so that requests (which carry their blocks' hashes) and the KV-cache
manager (which computes and looks them up) both import it, not each other.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import NamedTuple


class BlockHash(NamedTuple):
    """Chained hash of one full block, stored with the key it was computed from.

    A lookup compares the whole tuple, tokens included, so a hash collision can never hand
    one prompt another prompt's KV.
    """

    value: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: tuple


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    parent_value = None if parent is None else parent.value
    token_ids = tuple(token_ids)
    key = pickle.dumps((parent_value, token_ids, extra_keys), protocol=5)
    return BlockHash(hashlib.sha256(key).digest(), parent_value, token_ids, extra_keys)
