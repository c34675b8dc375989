"""LLMEngine: requests in, one scheduled step at a time, outputs out."""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import EngineConfig, UsageContext
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.executor import Executor, PendingOutput, get_executor_class
from engine.generation_config import (
    config_eos_token_id,
    end_of_sequence_ids,
    read_generation_defaults,
)
from engine.observability.metrics import EngineMetrics, MetricsSink, RequestTimes
from engine.outputs import CompletionOutput, RequestFailedError, RequestOutput, TokenLogprobs
from engine.sampling_params import (
    RequestInputError,
    RequestOutputKind,
    SamplingParams,
    StructuredOutput,
    truncate_prompt,
)
from engine.structured_output import StructuredOutputs
from engine.tokenizer import (
    IncrementalDetokenizer,
    encode_text,
    load_tokenizer,
)
from engine.worker.loader import ModelSource, load_hf_config, resolve_model_source, served_names
from engine.worker.sampler import held_back_below_min_tokens


@dataclass
class _Sample:
    """One of a request's n samples: a scheduler Request plus its text state."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    num_seen_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: int | str | None = None


@dataclass
class _ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample] = field(default_factory=list)
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


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        hf_config: Any,
        source: ModelSource,
        tokenizer: Any | None,
        executor_class: type[Executor] | None = None,
    ):
        self.config = config
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        model = config.model
        self.served_model_names = served_names(
            model.served_model_name, model.model, model.load_format
        )
        self.model_name = self.served_model_names[0]
        executor_class = executor_class or get_executor_class(config)
        self.executor = executor_class(config, hf_config, source)
        self.num_gpu_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_cache(self.num_gpu_blocks)
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, self.num_gpu_blocks
        )
        self.scheduler.schedule_placeholders = self.executor.supports_overlap
        self.scheduler.num_micro_batches = self.executor.max_concurrent_batches
        self.generation_defaults = read_generation_defaults(
            config.model.generation_config, source.path if source.kind == "hf" else None
        )
        eos_ids = end_of_sequence_ids(hf_config, tokenizer, self.generation_defaults)
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        runner_eos = config_eos_token_id(hf_config)
        self._runner_eos = runner_eos
        self.more_eos_token_ids = [t for t in eos_ids if t != runner_eos]
        """Ids that end a request as EOS does besides the one the model runner holds back
        for min_tokens (config.json's first): added to a request's stop_token_ids unless it
        ignores EOS."""
        self.vocab_size: int = hf_config.vocab_size
        self._parents: dict[str, _ParentRequest] = {}
        self._sample_parent: dict[str, str] = {}
        self._pending: deque[tuple[SchedulerOutput, PendingOutput]] = deque()
        """Steps launched whose tokens are not read yet, oldest first."""
        self._failed: dict[str, Exception] = {}
        """Requests a step failed on their own (parent id -> error), aborted, until
        take_failed() hands them over."""
        self.metrics: EngineMetrics | None = None
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_id)
        if config.device == "cuda":
            self.warm_up()
            self.executor.warn_of_late_kernel_variants()
        self.executor.freeze_worker_heaps()

    def warm_up(self) -> None:
        """A few tiny requests through a prefill over a block table, decodes, a step that
        mixes a decode with a prefill, steps that sample only at random, only greedily and
        both, and a step for each prefill attention tile size: Triton compiles these
        kernels now, not during the first requests (a short prompt or a chunk's short
        remainder picks a smaller tile than a long one; the sampling kernel has a variant
        for each mix). They leave nothing behind: no cached blocks, no prefix-cache
        counts."""
        from kernels.triton_attention import prefill_tile_query_lens

        room = self.config.scheduler_config.max_model_len - 4  # prompt + 4 new tokens fit
        if room <= 0:
            return
        hf = self.hf_config
        kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        group = hf.num_attention_heads // kv_heads
        tiles = prefill_tile_query_lens(group, self.config.model.dtype == "float32")
        token = min(self.vocab_size - 2 - len(tiles), 100)
        # The random one alone first, then beside greedy ones, then greedy ones alone.
        prompts = [(17, 1.0), (40, 0.0)] + [(length, 0.0) for length in tiles]
        for i, (length, temperature) in enumerate(prompts):
            params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
            self.add_request(f"kvray-warm-up-{i}", [token + i] * min(length, room), params)
            # Each arrives once the ones before it decode: its step is a mixed batch.
            while self.scheduler.waiting:
                self.step()
        while self.has_unfinished_requests():
            self.step()
        kv = self.scheduler.kv_cache_manager
        kv.reset_prefix_cache()
        kv.prefix_cache_queries = kv.prefix_cache_hits = 0

    def enable_metrics(self, sink: MetricsSink, flush_interval_s: float = 1.0) -> None:
        """Record engine metrics into `sink` from the next request on (see engine/observability/metrics.py)."""
        self.metrics = EngineMetrics(sink, self.model_name, flush_interval_s)

    @classmethod
    def from_engine_args(
        cls,
        model: str | None = None,
        tokenizer: str | None = None,
        usage_context: UsageContext = "offline",
        **engine_args: Any,
    ) -> LLMEngine:
        source = resolve_model_source(model, engine_args.get("load_format", "auto"))
        hf_config = load_hf_config(source)
        config = EngineConfig.create(
            hf_config=hf_config,
            usage_context=usage_context,
            model=str(source.path),
            tokenizer=tokenizer,
            **engine_args,
        )
        tok = _load_tokenizer_for(source, tokenizer)
        return cls(config, hf_config, source, tok)

    # -- requests -------------------------------------------------------------------------

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids, with the tokenizer's special tokens (a Llama 3's BOS) as
        vLLM tokenizes prompts; a tokenizer without a post-processor adds none."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass the prompt as token ids")
        return encode_text(self.tokenizer, prompt, add_special_tokens)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        grammar: Any = None,
    ) -> RequestOutput:
        """Queue a request; ValueError for input the engine cannot serve. `grammar`: the one
        `compile_grammar` returned for its structured_output (else it is compiled here).
        Returns the request's output as taken: its prompt, no tokens yet."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        n = sampling_params.n
        # A request's samples run as `id#i` when n > 1: no id may be another's sample's.
        ids = [request_id] if n == 1 else [request_id, *(f"{request_id}#{i}" for i in range(n))]
        taken = next((i for i in ids if i in self._parents or i in self._sample_parent), None)
        if taken is not None:
            raise ValueError(f"request_id {request_id!r} is already in use ({taken!r} runs)")
        if isinstance(prompt, str):
            prompt_text, prompt_ids = prompt, self.encode(prompt)
        else:
            prompt_text, prompt_ids = None, list(prompt)
        max_len = self.config.scheduler_config.max_model_len
        prompt_ids = truncate_prompt(prompt_ids, sampling_params.truncate_prompt_tokens, max_len)
        self._check_prompt(prompt_ids)
        self._check_token_ids(sampling_params)
        self._check_stop(sampling_params)
        sampling_params = self._with_every_eos(sampling_params)
        sampling_params = self._with_grammar_end_allowed(sampling_params)
        self._check_min_tokens_leave_a_token(sampling_params)
        if sampling_params.structured_output is None:
            grammar = None
        else:
            if grammar is None:
                grammar = self.structured.grammar(sampling_params.structured_output)
            self._check_grammar_meets_allowed_ids(sampling_params, grammar)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        parent = _ParentRequest(
            request_id,
            prompt_text,
            prompt_ids,
            times=RequestTimes(arrival_time),
            final_only=sampling_params.output_kind == RequestOutputKind.FINAL_ONLY,
            prompt_logprobs=None if sampling_params.prompt_logprobs is None else [None],
        )
        children = []
        for i in range(sampling_params.n):
            params = sampling_params
            sample_id = request_id
            if sampling_params.n > 1:
                sample_id = f"{request_id}#{i}"
                params = dataclasses.replace(
                    sampling_params,
                    n=1,
                    # Wrapped into the range a seed takes (the stream is the same).
                    seed=None
                    if sampling_params.seed is None
                    else (sampling_params.seed + i) % 2**64,
                )
            request = Request(
                request_id=sample_id,
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                eos_token_id=self.eos_token_id,
                arrival_time=arrival_time,
                priority=priority,
                cache_salt=cache_salt,
            )
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                )
            logprobs = [] if params.logprobs is not None else None
            children.append(_Sample(request, i, detok, logprobs=logprobs))
        for child in children:
            parent.samples.append(child)
            self._sample_parent[child.request.request_id] = request_id
            if grammar is not None:
                spec = sampling_params.structured_output
                self.structured.add(child.request.request_id, grammar, spec.starts_after_token_ids)
            self.scheduler.add_request(child.request)
        self._parents[request_id] = parent
        return self._make_output(parent)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults (vLLM's name)."""
        return SamplingParams(**self.generation_defaults.as_sampling_args())

    def _with_every_eos(self, params: SamplingParams) -> SamplingParams:
        more = [t for t in self.more_eos_token_ids if t not in params.stop_token_ids]
        if params.ignore_eos or not more:
            return params
        return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *more])

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        # Before the grammar compiles and the samples are built.
        self.scheduler.check_prompt_len(len(prompt_ids))
        bad = [t for t in prompt_ids if type(t) is not int or not 0 <= t < self.vocab_size]
        if not bad:
            return
        for t in bad:
            if not isinstance(t, numbers.Integral) or isinstance(t, bool):
                raise RequestInputError(
                    "prompt", f"must be text or token ids (ints), got {type(t).__name__} {t!r}"
                )
            if not 0 <= t < self.vocab_size:
                raise RequestInputError(
                    "prompt", f"token id {t} is out of range [0, {self.vocab_size})"
                )
        prompt_ids[:] = [int(t) for t in prompt_ids]  # numpy's integers, say

    def _with_grammar_end_allowed(self, params: SamplingParams) -> SamplingParams:
        """A structured output ends with EOS once its value is complete (the grammar allows
        nothing else then): allowed_token_ids take it too, or the request could not end."""
        allowed, eos = params.allowed_token_ids, self.eos_token_id
        if params.structured_output is None or allowed is None or eos is None or eos in allowed:
            return params
        return dataclasses.replace(params, allowed_token_ids=[*allowed, eos])

    def _check_min_tokens_leave_a_token(self, params: SamplingParams) -> None:
        """Below min_tokens, the ids that end a request are held back: allowed_token_ids
        made of those alone would leave nothing to sample."""
        if not params.min_tokens or params.allowed_token_ids is None:
            return
        held_back = held_back_below_min_tokens(params, self._runner_eos)
        if set(held_back).issuperset(params.allowed_token_ids):
            raise RequestInputError(
                "allowed_token_ids",
                f"hold only ids that end the request, which min_tokens={params.min_tokens} "
                "holds back: nothing could be sampled",
            )

    def _check_grammar_meets_allowed_ids(self, params: SamplingParams, grammar: Any) -> None:
        starts_later = params.structured_output.starts_after_token_ids is not None
        allowed = params.allowed_bitmask(self.vocab_size)
        if allowed is None or starts_later:
            return  # a later start is checked at each step (step())
        if not np.bitwise_and(self.structured.first_mask(grammar), allowed).any():
            raise RequestInputError(
                "allowed_token_ids",
                "allow none of the tokens the structured output may start with",
            )

    def _check_stop(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise RequestInputError(
                "stop", "needs the model's tokenizer, and this model has none: use stop_token_ids"
            )

    def _check_token_ids(self, params: SamplingParams) -> None:
        """The request's own ids are in the vocabulary (SamplingParams checks them >= 0);
        the EOS ids the engine adds to stop_token_ids are not the request's to answer for."""
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            bad = [t for t in getattr(params, name) or () if t >= self.vocab_size]
            if bad:
                raise RequestInputError(
                    name, f"token id {bad[0]} is out of range [0, {self.vocab_size})"
                )

    def abort_request(self, request_ids: Sequence[str]) -> None:
        sample_ids = []
        now = time.monotonic()
        for rid in request_ids:
            parent = self._parents.get(rid)
            if parent is None:
                continue
            if self.metrics is not None:
                self.metrics.request_finished(parent.times, "abort", now)
            self._forget(parent)
            sample_ids.extend(s.request.request_id for s in parent.samples)
        if sample_ids:
            self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)
        if self.metrics is not None:
            self.metrics.maybe_flush(self.stats, idle=not self.has_unfinished_requests())

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # -- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the steps that completed.

        With an executor that can overlap, step t+1 is scheduled and launched before step
        t's tokens are read back, so the host's work hides behind the device's. With
        pipeline stages, up to one step per stage is in flight, each carrying other
        requests, so that every stage has work.
        """
        outputs: list[RequestOutput] = []
        # A structured request's next mask follows from its latest token: read them all first.
        max_pending = 0 if self.structured else self._max_pending()
        while len(self._pending) > max_pending:
            outputs += self._complete(*self._pending.popleft())
        scheduler_output = self.scheduler.schedule()
        if self.structured:
            # A mask for each structured request that samples in this step; a prompt chunk
            # that does not reach the prompt's end samples nothing. Nothing was in flight
            # (see above), so a request samples now exactly when it holds a placeholder.
            requests = self.scheduler.requests
            masks = scheduler_output.grammar_bitmask = {}
            for rid in scheduler_output.num_scheduled_tokens:
                if self.structured.constrains(rid) and requests[rid].num_output_placeholders:
                    try:
                        masks[rid] = mask = self.structured.bitmask(rid)
                    except Exception as e:  # it samples unconstrained, then is aborted
                        self._fail(rid, e)
                        continue
                    request = requests[rid]
                    allowed = request.sampling_params.allowed_bitmask(self.vocab_size)
                    if allowed is not None and not np.bitwise_and(mask, allowed).any():
                        problem = (
                            "allow none of the tokens the structured output allows after "
                            f"{request.num_output_tokens} output tokens"
                        )
                        self._fail(rid, RequestInputError("allowed_token_ids", problem))
        if scheduler_output.is_empty and self._pending and not self.executor.supports_overlap:
            # Every runnable request waits for a step in flight: read that one, then schedule
            # again (this step's finished ids go to the workers with the next step).
            self.scheduler.defer_finished(scheduler_output)
            outputs += self._complete(*self._pending.popleft())
            scheduler_output = self.scheduler.schedule()
        if self.metrics is not None:
            self._record_scheduled(scheduler_output)
        self._pending.append(
            (scheduler_output, self.executor.execute_model_async(scheduler_output))
        )
        while len(self._pending) > max_pending:
            outputs += self._complete(*self._pending.popleft())
        if self._failed:
            outputs = [o for o in outputs if o.request_id not in self._failed]
            self.abort_request([rid for rid in self._failed if rid in self._parents])
        return outputs

    def take_failed(self) -> list[tuple[str, Exception]]:
        """The requests steps failed on their own since the last call (already aborted):
        their callers hear the error here, as no output of theirs will come."""
        failed, self._failed = list(self._failed.items()), {}
        return failed

    def _fail(self, sample_id: str, error: Exception) -> None:
        """Fail the sample's request at the end of this step: with `error` itself where it is
        the request's input's fault (RequestInputError), else with a RequestFailedError."""
        parent_id = self._sample_parent.get(sample_id)
        if parent_id is None or parent_id in self._failed:
            return
        if not isinstance(error, RequestInputError):
            error = RequestFailedError(
                f"request {parent_id} failed: {type(error).__name__}: {error}"
            )
        self._failed[parent_id] = error

    def _max_pending(self) -> int:
        """Steps that may stay in flight when step() returns."""
        overlap = self.executor.supports_overlap
        return max(self.executor.max_concurrent_batches, 2 if overlap else 1) - 1

    def _complete(self, scheduler_output: SchedulerOutput, launched: PendingOutput):
        runner_output = launched.result()
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        touched: dict[str, _ParentRequest] = {}
        for request in updated:
            parent_id = self._sample_parent.get(request.request_id)
            if parent_id is None or parent_id in self._failed:
                continue
            parent = self._parents[parent_id]
            sample = parent.samples[_sample_index(request.request_id, parent)]
            try:
                self._process_sample(sample, runner_output.logprobs.get(request.request_id))
            except Exception as e:
                self._fail(request.request_id, e)
                continue
            touched[parent_id] = parent
        for sample_id, (first, entries) in runner_output.prompt_logprobs.items():
            parent = self._parents.get(self._sample_parent.get(sample_id, ""))
            if parent is not None and parent.samples[0].request.request_id == sample_id:
                parent.add_prompt_logprobs(first, entries)
        outputs = []
        for parent in touched.values():
            if parent.request_id in self._failed:
                continue  # step() aborts it
            finished = parent.finished
            if finished or not parent.final_only:
                outputs.append(self._make_output(parent))
            if finished:
                self._forget(parent)
        if self.metrics is not None:
            self._record_step(scheduler_output, touched.values())
        return outputs

    def _record_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        now = time.monotonic()
        for new_req in scheduler_output.scheduled_new_reqs:
            parent = self._parents.get(self._sample_parent.get(new_req.req_id, ""))
            if parent is not None:
                self.metrics.request_scheduled(parent.times, now)

    def _record_step(
        self, scheduler_output: SchedulerOutput, touched: Iterable[_ParentRequest]
    ) -> None:
        metrics, now = self.metrics, time.monotonic()
        for parent in touched:
            num_generated = sum(s.request.num_output_tokens for s in parent.samples)
            if num_generated > parent.num_generated:
                metrics.request_tokens(
                    parent.times,
                    num_generated - parent.num_generated,
                    len(parent.prompt_token_ids),
                    now,
                )
                parent.num_generated = num_generated
            if parent.finished:
                # A request of n samples counts once, under its first sample's reason.
                reason = parent.samples[0].request.status.finish_reason
                metrics.request_finished(parent.times, reason, now)
        metrics.step(
            scheduler_output.total_num_scheduled_tokens,
            len(scheduler_output.num_scheduled_tokens),
        )
        metrics.maybe_flush(self.stats, idle=not self.has_unfinished_requests())

    def _forget(self, parent: _ParentRequest) -> None:
        self._parents.pop(parent.request_id, None)
        for s in parent.samples:
            self._sample_parent.pop(s.request.request_id, None)
            self.structured.remove(s.request.request_id)

    def _process_sample(self, sample: _Sample, logprobs: TokenLogprobs | None) -> None:
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

    def _make_output(self, parent: _ParentRequest) -> RequestOutput:
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

    def stats(self) -> dict[str, float]:
        return self.scheduler.stats()

    def compile_grammar(self, spec: StructuredOutput) -> Future:
        """The grammar for `spec`, compiled on a thread while the engine steps on (a Future:
        its result goes to add_request; a schema that cannot be followed is a ValueError)."""
        return self.structured.compile_in_background(spec)

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()


def _sample_index(sample_id: str, parent: _ParentRequest) -> int:
    if len(parent.samples) == 1:
        return 0
    return int(sample_id.rsplit("#", 1)[1])


def _load_tokenizer_for(source: ModelSource, tokenizer: str | None) -> Any | None:
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if source.kind == "gguf":
        path = Path(source.path)
        return load_tokenizer(path.parent, gguf_file=path.name)
    folder = Path(source.path)
    if folder.is_dir() and any((folder / f).exists() for f in _TOKENIZER_FILES):
        return load_tokenizer(folder)
    # No tokenizer (e.g. dummy shapes): prompts must be token ids, outputs have no text.
    return None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
