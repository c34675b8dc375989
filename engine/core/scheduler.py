"""Continuous batching with one token budget per step.

There are no prefill and decode phases. Every request has `num_tokens` known tokens and
`num_computed_tokens` whose KV is cached; each step the scheduler lets the computed count
catch up within `max_num_batched_tokens`. A decode wants 1 token, a fresh prompt wants all
of it, and a prompt longer than what is left of the budget gets a chunk (chunked prefill).
While requests decode, prompts share the smaller `max_prefill_tokens_with_decodes`: a step
that carries decodes stays short, so one arriving prompt holds the streams up briefly
(unless a whole step's worth of prompt tokens waits: then the queue comes first).
A request samples a token when a step brings it to the end of its known tokens.

Forks (scheduler_forks.py): the samples of a request with n > 1 share its prompt's KV, and
beams their parent's. A forked request the workers have not seen yet goes to them as a new
request; the copies to make go with the step (`SchedulerOutput.blocks_to_copy`). Swaps and
the prefix cache's CPU tier: kv_offload.py, which decides; the scheduler only asks it.

Longer than most modules: one step's decisions (running first, preemption, admission,
resumption from the CPU pool) read the same queues and budget, and split across files they
would hand those back and forth.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from engine.config import CacheConfig, SchedulerConfig
from engine.core.batch_wait import batch_wait_left
from engine.core.kv_cache import KVCacheManager
from engine.core.kv_offload import KVOffload, OffloadSettings
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_forks import SampleForks
from engine.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from engine.core.step_budget import StepBudget
from engine.sampling_params import RequestInputError


class Scheduler(SampleForks):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        offload: OffloadSettings | None = None,
    ):
        self.config = scheduler_config
        self.policy = scheduler_config.policy
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.block_size = cache_config.block_size
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        """Admission order: arrival for fcfs, (priority, arrival) for priority."""
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_req_ids: set[str] = set()
        self.schedule_placeholders = False
        """Schedule a request again while its sampled token is in flight. Only for executors
        whose workers feed that token from their own device-side samples (supports_overlap);
        otherwise a request waits for its token, and steps in flight carry other requests."""
        self.num_micro_batches = 1
        """Steps in flight at once (one per pipeline stage): each step takes about 1/n of the
        requests, so that while one batch is in stage 2 the next has work for stage 1."""
        self._num_sent_tokens: dict[str, int] = {}
        """req id -> how many of its tokens the workers hold (sent in full or as diffs)."""
        self.offload: KVOffload | None = None
        """The CPU pool (swap_space): swapped requests and the prefix cache's CPU tier."""
        if offload is not None:
            self.offload = KVOffload(
                self.kv_cache_manager, offload, scheduler_config.preemption_mode, self.policy
            )
        self.batch_wait_timeout_s = scheduler_config.batch_wait_timeout_ms / 1000
        """The dynamic batching timeout in force (LLMEngine.set_batch_wait_timeout_ms)."""
        self.num_admitting_steps = 0
        """Steps that admitted a waiting request (their prompts start there)."""
        self._awaiting_fork: dict[str, list[Request]] = {}
        """First sample's id -> the request's other samples (n > 1), waiting for its prompt
        to be computed to fork its blocks."""

    # -- requests ---------------------------------------------------------------------------

    def check_request(self, request: Request) -> None:
        """ValueError for a request that could never be scheduled."""
        self.check_prompt_len(request.num_prompt_tokens)

    def check_prompt_len(self, n: int) -> None:
        """RequestInputError for a prompt of `n` tokens that could never be scheduled."""
        if n == 0:
            raise RequestInputError("prompt", "is empty: it needs at least one token")
        if n >= self.max_model_len:
            raise RequestInputError(
                "prompt",
                f"has {n} tokens; max_model_len is {self.max_model_len} "
                f"(prompt plus at least one generated token must fit)",
            )
        capacity = self.kv_cache_manager.max_num_tokens
        if n > capacity:
            raise RequestInputError(
                "prompt",
                f"has {n} tokens but the whole KV cache holds {capacity} "
                f"({capacity // self.block_size} blocks of {self.block_size}); "
                f"shorten the prompt or raise num_gpu_blocks",
            )

    def add_request(self, request: Request, fork_of: str | None = None) -> None:
        """Queue `request`; with `fork_of` (the id of another sample of the same prompt and
        cache salt, added before it), it forks that one's prompt blocks once they are
        computed instead of computing the prompt itself."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already scheduled")
        self.check_request(request)
        self.requests[request.request_id] = request
        if fork_of is None or not self._await_fork(request, fork_of):
            self._add_waiting(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string); unknown or finished ids are skipped."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            self._dequeue(request)
            self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self._awaiting_fork or self._swapped())

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + self._num_waiting() + len(self._swapped())

    def _num_waiting(self) -> int:
        return len(self.waiting) + sum(len(s) for s in self._awaiting_fork.values())

    def _swapped(self) -> list[Request]:
        return self.offload.swapped if self.offload is not None else []

    def _dequeue(self, request: Request) -> None:
        """Take an unfinished request out of its queue: running, awaiting its fork, swapped
        or waiting."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif self._stop_awaiting_fork(request):
            pass
        elif self.offload is None or not self.offload.drop(request):
            self.waiting.remove(request)

    def stats(self) -> dict[str, float]:
        kv = self.kv_cache_manager
        stats = {
            "num_running": len(self.running),
            "num_waiting": self._num_waiting(),
            "num_preemptions": self.num_preemptions,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "kv_cache_fragmentation": self._fragmentation(),
        }
        if self.offload is not None:
            stats |= self.offload.stats()
            stats["prefix_cache_hits"] += stats["cpu_prefix_cache_hits"]
        return stats

    def _fragmentation(self) -> float:
        """Share of the running requests' token slots that hold no token (last-block waste)."""
        kv = self.kv_cache_manager
        num_slots = self.block_size * sum(
            len(kv.req_to_blocks.get(r.request_id, ())) for r in self.running
        )
        if num_slots == 0:
            return 0.0
        return 1.0 - sum(r.num_computed_tokens for r in self.running) / num_slots

    def batch_wait_left(self, now: float) -> float:
        """Seconds new requests are still held back (batch_wait_timeout_ms; 0: admit them
        now): engine/core/batch_wait.py."""
        return batch_wait_left(
            self.batch_wait_timeout_s,
            now,
            self.waiting,
            len(self.running),
            len(self._swapped()),
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
        )

    def schedule(self, admit_new: bool = True) -> SchedulerOutput:
        """The next step. `admit_new=False`: no waiting request is admitted (the batch
        waits for more arrivals); running requests are scheduled as always."""
        step = StepBudget(
            tokens=self.config.max_num_batched_tokens,
            prefill_tokens=self._prefill_budget(),
            max_seqs=self._max_seqs_this_step(),
        )
        self._schedule_running(step)
        # A step that had to preempt is short of blocks: admitting now would only thrash.
        forked = [] if step.preempted else self._fork_samples(step)
        scheduled_new = [] if step.preempted or not admit_new else self._admit_waiting(step)
        if scheduled_new:
            self.num_admitting_steps += 1
        new = {r.request_id for r in (*forked, *scheduled_new)}
        scheduled_running = [self.requests[r] for r in step.num_scheduled if r not in new]
        # Forked beams the workers have not seen yet (engine/beam_search.py).
        unsent = [r for r in scheduled_running if r.request_id not in self._num_sent_tokens]
        if unsent:
            scheduled_running = [r for r in scheduled_running if r not in unsent]

        output = SchedulerOutput(
            scheduled_new_reqs=[
                self._new_request_data(r) for r in (*unsent, *forked, *scheduled_new)
            ],
            scheduled_cached_reqs=[
                self._cached_request_data(r, step.new_block_ids[r.request_id])
                for r in scheduled_running
            ],
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=sum(step.num_scheduled.values()),
            finished_req_ids=self._finished_req_ids,
            blocks_to_copy=self.kv_cache_manager.take_block_copies(),
        )
        self._finished_req_ids = set()
        if self.offload is not None:
            output.kv_copies_in, output.kv_copies_out = self.offload.take_copies()
        # Advance now, as if the step already ran: update_from_output only appends tokens.
        for req_id, n in step.num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # this step samples its next token
        return output

    def _schedule_running(self, step: StepBudget) -> None:
        """Give the running requests their tokens in order, preempting from the back of the
        queue (the policy's victim) when blocks run out."""
        kv = self.kv_cache_manager
        i = 0
        while i < len(self.running) and step.tokens > 0 and len(step.num_scheduled) < step.max_seqs:
            request = self.running[i]
            num_wanted = self._num_wanted(request)
            num_new = min(num_wanted, step.tokens)
            is_prefill = num_wanted > 1 or request.num_computed_tokens < request.num_prompt_tokens
            if is_prefill:
                num_new = min(num_new, step.prefill_tokens)
            if num_new == 0:
                i += 1
                continue
            num_copies = len(kv.block_copies)
            while (block_ids := kv.allocate_slots(request, num_new)) is None:
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                step.refund(victim.request_id)
                self._preempt(victim)
                step.preempted = True
                if victim_index < i:
                    i -= 1
                if victim is request:
                    break
            if block_ids is None:
                continue
            if len(kv.block_copies) > num_copies and request.request_id in self._num_sent_tokens:
                # The workers' block table of a running request only grows: a request they
                # know never shares the block it writes into (forks copy at once).
                raise RuntimeError(f"request {request.request_id} wrote into a shared block")
            step.take(request.request_id, num_new, is_prefill)
            step.new_block_ids[request.request_id] = block_ids
            i += 1

    def _admit_waiting(self, step: StepBudget) -> list[Request]:
        """Admit waiting requests from the head of the queue while the step has room."""
        kv = self.kv_cache_manager
        admitted: list[Request] = []
        while (
            (self.waiting or self._swapped())
            and min(step.tokens, step.prefill_tokens) > 0
            and len(self.running) < self.config.max_num_seqs
            and len(step.num_scheduled) < step.max_seqs
        ):
            head = self.waiting[0] if self.waiting else None
            resumed = self.offload.next_to_resume(head) if self.offload is not None else None
            if resumed is not None:
                # Swapped out: its KV comes back from the CPU pool, nothing is recomputed.
                request = resumed
                num_new = min(self._num_wanted(request), step.tokens, step.prefill_tokens)
                if self.offload.resume(request, num_new) is None:
                    break
            elif head is None:
                break
            else:
                request = head
                computed_blocks, num_hit = kv.get_computed_blocks(request)
                cpu_hits = self._cpu_prefix_hits(request, len(computed_blocks))
                num_cpu_hit = len(cpu_hits) * self.block_size
                num_new = min(
                    request.num_tokens - num_hit - num_cpu_hit, step.tokens, step.prefill_tokens
                )
                new_ids = kv.allocate_slots(request, num_cpu_hit + num_new, computed_blocks)
                if new_ids is None:
                    if self._swap_out_for(request, step, admitted):
                        continue
                    break  # the head of the queue waits for blocks; nothing behind it jumps ahead
                if cpu_hits:
                    self.offload.copy_in_hits(cpu_hits, new_ids)
                    num_hit += num_cpu_hit
                self.waiting.pop(0)
                if request.status == RequestStatus.WAITING:
                    request.num_cached_tokens = num_hit
                request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(request)
            step.num_scheduled[request.request_id] = num_new
            step.tokens -= num_new
            step.prefill_tokens -= num_new
        return admitted

    def _cpu_prefix_hits(self, request: Request, num_gpu_hit_blocks: int) -> list[int]:
        if self.offload is None:
            return []
        return self.offload.cpu_prefix_hits(request, num_gpu_hit_blocks)

    def _swap_out_for(self, request: Request, step: StepBudget, admitted: list[Request]) -> bool:
        """Under the priority policy, a waiting request more urgent than the least urgent
        running one takes that one's blocks by swapping it out (never by recomputing it: the
        victim keeps its work). True if it did."""
        if self.offload is None or self.policy != "priority" or not self.running:
            return False
        victim = self._pick_victim()
        if (
            victim.priority <= request.priority
            or victim in admitted
            or not self.offload.can_swap(victim)
        ):
            return False
        step.refund(victim.request_id)
        self._preempt(victim)
        return True

    def defer_finished(self, output: SchedulerOutput) -> None:
        """Send an unlaunched (empty) output's finished ids and KV copies with the next step
        instead."""
        self._finished_req_ids |= output.finished_req_ids
        if self.offload is not None:
            self.offload.defer_copies()

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may take: max_prefill_tokens_with_decodes while a running
        request is past its prompt (decoding), else the whole step's budget.

        With a whole step's worth of tokens waiting, the server is behind its arrivals and
        short steps would only let the queue grow: prompts get the whole budget again.
        """
        cap = self.config.max_prefill_tokens_with_decodes
        budget = self.config.max_num_batched_tokens
        if not cap or not any(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running):
            return budget
        num_waiting_tokens = 0
        for request in self.waiting:
            num_waiting_tokens += request.num_tokens
            if num_waiting_tokens >= budget:
                return budget
        return cap

    def _max_seqs_this_step(self) -> int:
        if self.num_micro_batches == 1:
            return self.config.max_num_seqs
        num_requests = len(self.running) + len(self.waiting)
        return max(1, -(-num_requests // self.num_micro_batches))

    def _num_wanted(self, request: Request) -> int:
        """Tokens a running request can compute now.

        With a step in flight (asynchronous scheduling) a request's sampled token is not yet
        appended: it counts as a placeholder, computed next step from the device-side value.
        A request whose in-flight token is its last (max_tokens, max_model_len) waits.
        """
        if not self.schedule_placeholders:
            return request.num_tokens - request.num_computed_tokens
        placeholders = request.num_output_placeholders
        if placeholders:
            max_tokens = request.sampling_params.max_tokens
            num_outputs = request.num_output_tokens + placeholders
            if (max_tokens is not None and num_outputs >= max_tokens) or (
                request.num_tokens + placeholders >= self.max_model_len
            ):
                return 0
        return request.num_tokens + placeholders - request.num_computed_tokens

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Append sampled tokens and apply stop conditions; the requests that got a token."""
        updated = []
        for req_id in scheduler_output.num_scheduled_tokens:
            token = runner_output.sampled_token_ids.get(req_id)
            request = self.requests.get(req_id)
            if token is None or request is None or request.is_finished:
                continue
            request.num_output_placeholders = max(0, request.num_output_placeholders - 1)
            request.append_output_token_ids(token)
            status = self._check_stop(request)
            if status is not None:
                # A request preempted while its step was in flight waits in a queue.
                self._dequeue(request)
                self._finish(request, status)
            updated.append(request)
        return updated

    # -- helpers ----------------------------------------------------------------------------

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        # The next step would need KV for every known token; past the whole cache that can
        # never be scheduled, so end here rather than wait forever.
        if request.num_tokens > self.kv_cache_manager.max_num_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _add_waiting(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            # A preempted request goes before its equals, a new one after them.
            insort = bisect.insort_left if front else bisect.insort_right
            insort(self.waiting, request, key=lambda r: (r.priority, r.arrival_time))
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def _pick_victim(self) -> Request:
        """The running request to preempt: least urgent, then latest arrived (then admitted)."""
        if self.policy == "priority":
            key = lambda i: (self.running[i].priority, self.running[i].arrival_time, i)
        else:
            key = lambda i: (self.running[i].arrival_time, i)
        return self.running[max(range(len(self.running)), key=key)]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_forks(request)
        # Swapped (preemption_mode, room in the CPU pool): it keeps its computed tokens and
        # waits in the offload's queue; else they are recomputed when it resumes.
        swapped = self.offload is not None and self.offload.swap_out(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        if not swapped:
            request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._forget_on_workers(request)
        if not swapped:
            self._add_waiting(request, front=True)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._release_forks(request)
        self.kv_cache_manager.free(request)
        self._forget_on_workers(request)
        del self.requests[request.request_id]

    def _forget_on_workers(self, request: Request) -> None:
        if self._num_sent_tokens.pop(request.request_id, None) is not None:
            self._finished_req_ids.add(request.request_id)

    def _new_request_data(self, request: Request) -> NewRequestData:
        self._num_sent_tokens[request.request_id] = request.num_tokens
        return NewRequestData(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request),
            num_computed_tokens=request.num_computed_tokens,
        )

    def _cached_request_data(self, request: Request, new_block_ids: list[int]) -> CachedRequestData:
        num_sent = self._num_sent_tokens[request.request_id]
        self._num_sent_tokens[request.request_id] = request.num_tokens
        return CachedRequestData(
            req_id=request.request_id,
            new_token_ids=request.all_token_ids[num_sent:],
            new_block_ids=new_block_ids,
            num_computed_tokens=request.num_computed_tokens,
        )
