"""The scheduler's forks: samples of one prompt (n > 1) that share its KV, and beams that
share their parent's (engine/beam_search.py).

The first sample of a request with n > 1 computes the prompt; each other one waits
(`_awaiting_fork`, by first sample's id) until it has, then forks its blocks and
recomputes only the prompt's last token, whose logits it samples from (the last block,
partial, is copied first: kv_cache.py's copy-on-write). A beam forks its parent's blocks
the same way (`fork_request`). `SampleForks` is a mixin of `Scheduler` (scheduler.py),
whose queues and KV manager it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.request import Request, RequestStatus
from engine.core.step_budget import StepBudget

if TYPE_CHECKING:
    from engine.config import SchedulerConfig
    from engine.core.kv_cache import KVCacheManager


class SampleForks:
    requests: dict[str, Request]
    running: list[Request]
    kv_cache_manager: KVCacheManager
    config: SchedulerConfig
    _awaiting_fork: dict[str, list[Request]]

    def check_request(self, request: Request) -> None:
        raise NotImplementedError

    def _add_waiting(self, request: Request, front: bool = False) -> None:
        raise NotImplementedError

    def _await_fork(self, request: Request, leader_id: str) -> bool:
        """Queue a sample to fork the prompt of `leader_id` (another sample of the same
        prompt and cache salt) once it is computed; False when that one has left."""
        leader = self.requests.get(leader_id)
        if leader is None or leader.status not in (RequestStatus.WAITING, RequestStatus.RUNNING):
            return False
        same = (leader.prompt_token_ids, leader.cache_salt) == (
            request.prompt_token_ids,
            request.cache_salt,
        )
        if not same:
            raise ValueError(f"request {request.request_id!r} forks another prompt or salt")
        self._awaiting_fork.setdefault(leader_id, []).append(request)
        return True

    def fork_request(self, parent: Request, child: Request) -> None:
        """Add `child`, whose tokens continue `parent`'s computed ones, sharing the parent's
        blocks: it computes only its tokens past them. A parent that holds no computed KV
        (preempted, waiting) gives nothing to share: the child is queued as a new request."""
        if child.request_id in self.requests:
            raise ValueError(f"request_id {child.request_id!r} is already scheduled")
        if child.num_tokens <= parent.num_computed_tokens:
            raise ValueError("a forked request needs a token past its parent's computed ones")
        self.check_request(child)
        self.requests[child.request_id] = child
        kv = self.kv_cache_manager
        if parent.status != RequestStatus.RUNNING or parent.num_computed_tokens == 0:
            self._add_waiting(child)
            return
        kv.fork(parent, child, parent.num_computed_tokens)
        child.status = RequestStatus.RUNNING
        child.num_cached_tokens = parent.num_cached_tokens
        self.running.append(child)

    def _stop_awaiting_fork(self, request: Request) -> bool:
        for leader_id, samples in self._awaiting_fork.items():
            if request in samples:
                samples.remove(request)
                if not samples:
                    del self._awaiting_fork[leader_id]
                return True
        return False

    def _fork_samples(self, step: StepBudget) -> list[Request]:
        """Fork the samples whose first sample's prompt is computed: each shares its
        blocks and computes the prompt's last token again, for the logits it samples from.
        Only as many as the step has room for; the others wait for a later step."""
        kv = self.kv_cache_manager
        forked: list[Request] = []
        for leader_id in list(self._awaiting_fork):
            leader = self.requests[leader_id]
            if (
                leader.status != RequestStatus.RUNNING
                or leader.num_computed_tokens < leader.num_prompt_tokens
            ):
                continue
            samples = self._awaiting_fork[leader_id]
            while (
                samples
                and step.tokens > 0
                and len(self.running) < self.config.max_num_seqs
                and len(step.num_scheduled) < step.max_seqs
            ):
                sample = samples[0]
                kv.fork(leader, sample, leader.num_prompt_tokens - 1)
                # Its first write copies the shared last block: it never holds a shared
                # block the workers see it write into.
                if kv.allocate_slots(sample, 1) is None:
                    kv.free(sample)
                    sample.num_computed_tokens = 0
                    return forked  # short of blocks: the rest wait
                samples.pop(0)
                sample.status = RequestStatus.RUNNING
                sample.num_cached_tokens = leader.num_cached_tokens
                self.running.append(sample)
                forked.append(sample)
                step.num_scheduled[sample.request_id] = 1
                step.tokens -= 1
            if not samples:
                del self._awaiting_fork[leader_id]
        return forked

    def _release_forks(self, leader: Request) -> None:
        """A first sample that leaves the running queue before its samples forked: they
        compute their prompt themselves (with prefix caching, mostly as hits)."""
        for sample in self._awaiting_fork.pop(leader.request_id, ()):
            self._add_waiting(sample)
