"""From the scheduler's requests to the callers' RequestOutputs.

A request with n > 1 samples runs as n scheduler requests, `id#0` .. `id#{n-1}` (the id
itself when n == 1; the others fork `id#0`'s prompt blocks): `OutputProcessor` keeps each request's samples together, turns their
new tokens into text (stop strings finish a sample here), collects logprobs, and builds
the request's cumulative `RequestOutput`. A request a step fails on alone is kept aside
(`failed`) until the engine aborts it and hands its error over.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput
from engine.input_processor import ProcessedInput
from engine.observability.metrics import RequestTimes
from engine.outputs import CompletionOutput, RequestFailedError, RequestOutput, TokenLogprobs
from engine.sampling_params import RequestInputError, RequestOutputKind, SamplingParams
from engine.structured_output import StructuredOutputs
from engine.tokenizer import IncrementalDetokenizer


@dataclass
class Sample:
    """One of a request's n samples: a scheduler Request plus its text state."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    num_seen_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: int | str | None = None


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Sample] = field(default_factory=list)
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.monotonic()))
    num_generated: int = 0
    """Tokens of all samples already counted by metrics."""
    final_only: bool = False
    """Make an output only when the request finishes (RequestOutputKind.FINAL_ONLY)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With SamplingParams.prompt_logprobs: the first sample's, position by position."""

    @property
    def finished(self) -> bool:
        return all(s.request.status.is_finished for s in self.samples)

    def add_prompt_logprobs(self, first: int, entries: list[TokenLogprobs]) -> None:
        """Entries from `first` on; positions already known (a preempted request computes
        its prompt again) are kept as they are."""
        known = self.prompt_logprobs
        if known is not None and first <= len(known) < first + len(entries):
            known.extend(entries[len(known) - first :])


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """Each sample's scheduler request id and SamplingParams (n=1, its own seed)."""
    if params.n == 1:
        return [(request_id, params)]
    samples = []
    for i in range(params.n):
        # Wrapped into the range a seed takes (the stream is the same).
        seed = None if params.seed is None else (params.seed + i) % 2**64
        samples.append((f"{request_id}#{i}", dataclasses.replace(params, n=1, seed=seed)))
    return samples


def _sample_index(sample_id: str, parent: ParentRequest) -> int:
    if len(parent.samples) == 1:
        return 0
    return int(sample_id.rsplit("#", 1)[1])


class OutputProcessor:
    def __init__(
        self, tokenizer: Any | None, scheduler: Scheduler, structured: StructuredOutputs
    ) -> None:
        """`scheduler`: where a sample that meets a stop string is finished."""
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.structured = structured
        self.parents: dict[str, ParentRequest] = {}
        self.sample_parent: dict[str, str] = {}
        self.failed: dict[str, Exception] = {}
        """Requests a step failed on their own (parent id -> error), aborted, until
        take_failed() hands them over."""

    # -- requests in --------------------------------------------------------------------

    def check_id_free(self, request_id: str, n: int) -> None:
        # A request's samples run as `id#i` when n > 1: no id may be another's sample's.
        ids = [request_id] if n == 1 else [request_id, *(f"{request_id}#{i}" for i in range(n))]
        taken = next((i for i in ids if i in self.parents or i in self.sample_parent), None)
        if taken is not None:
            raise ValueError(f"request_id {request_id!r} is already in use ({taken!r} runs)")

    def new_parent(
        self,
        request_id: str,
        taken: ProcessedInput,
        requests: list[Request],
        arrival_time: float,
    ) -> ParentRequest:
        """The request and its samples' text state, one sample per scheduler request (in
        fan_out's order); nothing is tracked yet."""
        params = taken.sampling_params
        parent = ParentRequest(
            request_id,
            taken.prompt,
            taken.prompt_token_ids,
            times=RequestTimes(arrival_time),
            final_only=params.output_kind == RequestOutputKind.FINAL_ONLY,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )
        samples = []
        for i, request in enumerate(requests):
            sample_params = request.sampling_params
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    taken.prompt_token_ids,
                    skip_special_tokens=sample_params.skip_special_tokens,
                    stop=sample_params.stop,
                    include_stop_str_in_output=sample_params.include_stop_str_in_output,
                    min_tokens=sample_params.min_tokens,
                )
            logprobs = [] if sample_params.logprobs is not None else None
            samples.append(Sample(request, i, detok, logprobs=logprobs))
        parent.samples.extend(samples)
        return parent

    def add_request(self, parent: ParentRequest, start: Callable[[Request], None]) -> None:
        """Track `parent`; `start` hands each sample's request to the scheduler."""
        for sample in parent.samples:
            self.sample_parent[sample.request.request_id] = parent.request_id
            start(sample.request)
        self.parents[parent.request_id] = parent

    def parent_of(self, sample_id: str) -> ParentRequest | None:
        return self.parents.get(self.sample_parent.get(sample_id, ""))

    def abort(self, request_ids: Sequence[str]) -> list[ParentRequest]:
        """Stop tracking these requests (unknown ids are skipped); the ones that were."""
        aborted = []
        for rid in request_ids:
            parent = self.parents.get(rid)
            if parent is not None:
                self.forget(parent)
                aborted.append(parent)
        return aborted

    def forget(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for s in parent.samples:
            self.sample_parent.pop(s.request.request_id, None)
            self.structured.remove(s.request.request_id)

    # -- failures -----------------------------------------------------------------------

    def fail(self, sample_id: str, error: Exception) -> None:
        """Fail the sample's request at the end of this step: with `error` itself where it is
        the request's input's fault (RequestInputError), else with a RequestFailedError."""
        parent_id = self.sample_parent.get(sample_id)
        if parent_id is None or parent_id in self.failed:
            return
        if not isinstance(error, RequestInputError):
            error = RequestFailedError(
                f"request {parent_id} failed: {type(error).__name__}: {error}"
            )
        self.failed[parent_id] = error

    def take_failed(self) -> list[tuple[str, Exception]]:
        failed, self.failed = list(self.failed.items()), {}
        return failed

    # -- outputs ------------------------------------------------------------------------

    def process_outputs(
        self, updated: Iterable[Request], runner_output: ModelRunnerOutput
    ) -> tuple[list[RequestOutput], list[ParentRequest]]:
        """A completed step's new tokens (`updated`: the requests that got one) into the
        outputs to hand back, and the requests the step touched."""
        touched: dict[str, ParentRequest] = {}
        for request in updated:
            parent_id = self.sample_parent.get(request.request_id)
            if parent_id is None or parent_id in self.failed:
                continue
            parent = self.parents[parent_id]
            sample = parent.samples[_sample_index(request.request_id, parent)]
            try:
                self.process_sample(sample, runner_output.logprobs.get(request.request_id))
            except Exception as e:
                self.fail(request.request_id, e)
                continue
            touched[parent_id] = parent
        for sample_id, (first, entries) in runner_output.prompt_logprobs.items():
            parent = self.parent_of(sample_id)
            if parent is not None and parent.samples[0].request.request_id == sample_id:
                parent.add_prompt_logprobs(first, entries)
        outputs = []
        for parent in touched.values():
            if parent.request_id in self.failed:
                continue  # the engine aborts it
            finished = parent.finished
            if finished or not parent.final_only:
                outputs.append(self.make_output(parent))
            if finished:
                self.forget(parent)
        return outputs, list(touched.values())

    def process_sample(self, sample: Sample, logprobs: TokenLogprobs | None) -> None:
        request = sample.request
        new_ids = request.output_token_ids[sample.num_seen_tokens :]
        sample.num_seen_tokens = len(request.output_token_ids)
        if self.structured:
            self.structured.accept(request.request_id, new_ids)
        if logprobs is not None and sample.logprobs is not None:
            sample.logprobs.append(logprobs)
        if sample.detokenizer is None:
            return
        stop_str = sample.detokenizer.update(new_ids)
        if stop_str is not None and not request.status.is_finished:
            sample.stop_reason = stop_str
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        if request.status.is_finished:
            sample.detokenizer.finish()

    def make_output(self, parent: ParentRequest) -> RequestOutput:
        completions = []
        for s in parent.samples:
            request = s.request
            finish_reason = request.status.finish_reason if request.status.is_finished else None
            stop_reason = s.stop_reason if s.stop_reason is not None else request.stop_reason
            completions.append(
                CompletionOutput(
                    index=s.index,
                    text=s.detokenizer.output_text if s.detokenizer else "",
                    token_ids=list(request.output_token_ids),
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                )
            )
        prompt_logprobs = parent.prompt_logprobs
        if prompt_logprobs is not None and len(prompt_logprobs) < len(parent.prompt_token_ids):
            prompt_logprobs = None  # the prompt is still being computed
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=parent.finished,
            num_cached_tokens=min(s.request.num_cached_tokens for s in parent.samples),
        )
