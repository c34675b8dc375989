"""The contract between the scheduler and the workers: the only thing that crosses to them.

New requests are sent in full once; running requests as diffs. A request resumed after
preemption is sent again as a new request (its blocks were freed, its tokens are recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]
    """Every known token: prompt, then outputs generated before a preemption (if any)."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache hits)."""


@dataclass
class CachedRequestData:
    req_id: str
    new_token_ids: list[int]
    """Tokens appended since the workers last saw this request (the last sampled token)."""
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """req_id -> tokens computed this step; dict order is the batch order."""
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished, aborted or preempted since the last step: workers drop their state."""
    grammar_bitmask: dict[str, np.ndarray] = field(default_factory=dict)
    """req_id -> int32 words of the tokens its structured output allows next (bit i of word
    w: token 32w + i); requests without one sample freely."""
    kv_copies_out: list[tuple[int, int]] = field(default_factory=list)
    """(GPU block, CPU block) pairs to copy to the CPU pool before this step's forward
    overwrites them: swapped-out requests and blocks evicted to the prefix cache's CPU tier
    (engine/core/kv_offload.py). Every rank copies its own shard."""
    kv_copies_in: list[tuple[int, int]] = field(default_factory=list)
    """(CPU block, GPU block) pairs to copy back before this step's forward reads them:
    resumed requests and CPU-tier prefix hits. A step reads before it writes: copies in
    read the pool before copies out write it."""
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) KV blocks every worker copies before the forward: the
    copy-on-write of a block forked requests shared (engine/core/kv_cache.py)."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Sampled tokens for the requests that reached the end of their known tokens this step."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, object] = field(default_factory=dict)
    """req_id -> engine.outputs.TokenLogprobs, when the request asked for logprobs."""
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)
    """req_id -> (position of the first, TokenLogprobs of the prompt tokens at the positions
    that follow), for requests with prompt_logprobs whose prompt was computed this step."""
