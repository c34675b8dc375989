"""Request state as the scheduler and the KV-cache manager see it."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable

from engine.core.block_hash import BlockHash
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: "stop", "length" or "abort"; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        """Lower is more urgent; only the "priority" scheduling policy reads it."""
        self.cache_salt = cache_salt
        """Prefix-cache namespace: requests with different salts never share KV blocks."""

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        """The stop token id (or stop string) that finished the request, if any."""
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        """Prompt then outputs; kept in sync by append_output_token_ids."""
        self.num_computed_tokens = 0
        """Tokens whose KV is in the cache, or scheduled to be by the step in flight."""
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache when the request was first scheduled."""
        self.num_preemptions = 0
        self.num_output_placeholders = 0
        """Tokens sampled by a step still in flight, not yet appended (asynchronous scheduling)."""
        self.block_hashes: list[BlockHash] = []
        """Chained hashes of the full blocks of all_token_ids, filled by the KV-cache manager."""

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        else:
            token_ids = list(token_ids)
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
