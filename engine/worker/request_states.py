"""The runner's copy of every scheduled request: its tokens, block table and sampling state.

The scheduler sends new requests in full and running ones as diffs
(engine/core/scheduler_output.py); `RequestStates.update` applies a step's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.scheduler_output import SchedulerOutput
from engine.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    num_pending: int = 0
    """Tokens this runner sampled that have not come back in a diff yet (at most 2 with a
    step in flight); the newest is read from the previous step's device-side samples."""

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class RequestStates:
    def __init__(self, device: torch.device):
        self.device = device
        self._by_id: dict[str, CachedRequestState] = {}
        self.wants_prompt_logprobs: set[str] = set()
        """Requests with SamplingParams.prompt_logprobs (the others skip that work)."""

    def __getitem__(self, req_id: str) -> CachedRequestState:
        return self._by_id[req_id]

    def update(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self._by_id.pop(req_id, None)
            self.wants_prompt_logprobs.discard(req_id)
        for new in out.scheduled_new_reqs:
            params = new.sampling_params
            if params.prompt_logprobs is not None:
                self.wants_prompt_logprobs.add(new.req_id)
            generator = None
            if params.seed is not None:  # seeded before each draw (sampling_batch.token_seed)
                generator = torch.Generator(device=self.device)
            self._by_id[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=generator,
            )
        for cached in out.scheduled_cached_reqs:
            state = self._by_id[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.num_pending = max(0, state.num_pending - len(cached.new_token_ids))
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
