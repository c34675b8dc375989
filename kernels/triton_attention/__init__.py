"""Triton paged KV store and paged attention; drop-ins for kernels.attention_ref.

Two attention kernels, picked on the host from max_query_len:

- decode (every request has one query token): flash-decoding. Each program owns one
  (request, kv head, context partition) and loads the query rows of all heads in that
  kv head's group together, so every KV block is read once per group. The last partition
  of a (request, kv head) to finish merges them all by their log-sum-exp (a counter per
  pair says which one is last), so a decode is one launch; a context that fits one
  partition writes its output directly. (decode.py)
- general (prefill chunks, possibly mixed with decodes): each program owns a tile of
  query tokens x group heads of one request and kv head, and walks the request's blocks
  up to the tile's last causal position. (prefill.py)

Both are CUDA-graph capturable: grids and temporaries are sized from shapes and from
max_seq_len / max_query_len, which the caller passes as Python ints (upper bounds are
fine: programs past a request's real length return at once). paged_attention.py picks
and launches them; tuning.py holds their tile sizes and split counts; store_kv.py writes
the cache they read.
"""

from kernels.triton_attention.paged_attention import paged_attention_triton, warm_up_decode
from kernels.triton_attention.store_kv import paged_slot_offsets, store_kv_triton
from kernels.triton_attention.tuning import (
    DECODE_MAX_SPLITS,
    decode_num_splits,
    decode_split_variants,
    prefill_block_m,
    prefill_tile_query_lens,
)

__all__ = [
    "DECODE_MAX_SPLITS",
    "decode_num_splits",
    "decode_split_variants",
    "paged_attention_triton",
    "paged_slot_offsets",
    "prefill_block_m",
    "prefill_tile_query_lens",
    "store_kv_triton",
    "warm_up_decode",
]
