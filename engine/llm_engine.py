"""LLMEngine: requests in, one scheduled step at a time, outputs out.

The engine owns the step loop; what comes in is checked and completed by its
`InputProcessor` (engine/input_processor.py), what goes out is built by its
`OutputProcessor` (engine/output_processor.py).

Longer than most modules: the step loop (scheduling, the steps in flight, reading them
back, the hold of dynamic batching, structured and beam-search requests that cannot run
ahead) works on one queue of pending steps, and split across files that queue and its
rules would be handed back and forth; the model lifecycle is already apart
(engine/lifecycle.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from engine.beam_search import BeamSearches
from engine.config import EngineArgs, EngineConfig, UsageContext
from engine.core.kv_offload import offload_settings
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.executor import Executor, PendingOutput, get_executor_class
from engine.generation_config import (
    config_eos_token_id,
    end_of_sequence_ids,
    read_generation_defaults,
)
from engine.input_processor import InputProcessor, check_request_id, load_tokenizer_for
from engine.lifecycle import ModelLifecycle
from engine.observability.metrics import EngineMetrics, MetricsSink
from engine.output_processor import OutputProcessor, ParentRequest, fan_out
from engine.outputs import RequestOutput
from engine.sampling_params import RequestInputError, SamplingParams, StructuredOutput
from engine.structured_output import StructuredOutputs
from engine.worker.loader import ModelSource, load_hf_config, resolve_model_source, served_names
from engine.worker.warmup import warm_up_requests

logger = logging.getLogger(__name__)


class LLMEngine(ModelLifecycle):
    """Steps requests through one model; switching and sleeping it: engine/lifecycle.py."""

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
        self._log_start(config)
        offload = offload_settings(
            self.executor.kv_swap_info(), config.scheduler_config.preemption_mode
        )
        self.num_cpu_blocks = offload.num_cpu_blocks if offload is not None else 0
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, self.num_gpu_blocks, offload
        )
        self.scheduler.schedule_placeholders = self.executor.supports_overlap
        self.scheduler.num_micro_batches = self.executor.max_concurrent_batches
        self.generation_defaults = read_generation_defaults(
            config.model.generation_config, source.path if source.kind in ("hf", "gguf") else None
        )
        eos_ids = end_of_sequence_ids(hf_config, tokenizer, self.generation_defaults)
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        runner_eos = config_eos_token_id(hf_config)
        self.more_eos_token_ids = [t for t in eos_ids if t != runner_eos]
        """Ids that end a request as EOS does besides the one the model runner holds back
        for min_tokens (config.json's first): added to a request's stop_token_ids unless it
        ignores EOS."""
        self.vocab_size: int = hf_config.vocab_size
        self._pending: deque[tuple[SchedulerOutput, PendingOutput]] = deque()
        """Steps launched whose tokens are not read yet, oldest first."""
        self.metrics: EngineMetrics | None = None
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_id)
        self.input_processor = InputProcessor(
            tokenizer,
            self.vocab_size,
            config.scheduler_config.max_model_len,
            eos_token_id=self.eos_token_id,
            runner_eos_token_id=runner_eos,
            more_eos_token_ids=self.more_eos_token_ids,
            check_prompt_len=self.scheduler.check_prompt_len,
            structured=self.structured,
        )
        self.output_processor = OutputProcessor(tokenizer, self.scheduler, self.structured)
        self.beam_searches = BeamSearches(self.scheduler, self.input_processor, tokenizer, eos_ids)
        """Requests with use_beam_search (engine/beam_search.py)."""
        if config.device == "cuda":
            self.warm_up()
            self.executor.warn_of_late_kernel_variants()
        self.executor.freeze_worker_heaps()

    def _log_start(self, config: EngineConfig) -> None:
        """What runs: the weights' dtype and quantization (the KV cache's line is
        engine/worker/kv_memory.py's)."""
        logger.info(
            "%s: %s weights, quantization %s, on %s",
            self.model_name,
            config.model.dtype,
            config.model.quantization,
            config.device,
        )

    def warm_up(self) -> None:
        """Run the warm-up requests (engine/worker/warmup.py) through a few steps, so that
        Triton compiles the kernels they launch now, not during the first requests. They
        leave nothing behind: no cached blocks, no prefix-cache counts."""
        requests = warm_up_requests(self.config, self.hf_config)
        if not requests:
            return
        for i, (prompt_token_ids, params) in enumerate(requests):
            self.add_request(f"kvray-warm-up-{i}", prompt_token_ids, params)
            # Each arrives once the ones before it decode: its step is a mixed batch.
            while self.scheduler.waiting:
                self.step()
        while self.has_unfinished_requests():
            self.step()
        kv = self.scheduler.kv_cache_manager
        kv.reset_prefix_cache()
        kv.prefix_cache_queries = kv.prefix_cache_hits = 0
        if self.scheduler.offload is not None:
            self.scheduler.offload.reset_prefix_cache()

    def enable_metrics(self, sink: MetricsSink, flush_interval_s: float = 1.0) -> None:
        """Record engine metrics into `sink` from the next request on (see engine/observability/metrics.py)."""
        self.metrics = EngineMetrics(sink, self.model_name, flush_interval_s)

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs | None = None,
        usage_context: UsageContext = "offline",
        **kwargs: Any,
    ) -> LLMEngine:
        """The engine `engine_args` describe, or one built from keyword arguments
        (model=..., tensor_parallel_size=2, ...)."""
        args = EngineArgs.of(engine_args, kwargs)
        args.check_device_keys()
        source = resolve_model_source(args.model, args.load_format)
        hf_config = load_hf_config(source)
        resolved = args.model_copy(update={"model": str(source.path)})
        config = resolved.create_engine_config(hf_config, usage_context)
        tok = load_tokenizer_for(source, args.tokenizer, args.tokenizer_mode)
        engine = cls(config, hf_config, source, tok)
        engine.engine_args, engine.usage_context = args, usage_context
        return engine

    # -- requests -------------------------------------------------------------------------

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids, with the tokenizer's special tokens (a Llama 3's BOS) as
        vLLM tokenizes prompts; a tokenizer without a post-processor adds none."""
        return self.input_processor.encode(prompt, add_special_tokens)

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
        self.check_awake()
        check_request_id(request_id)
        if sampling_params.use_beam_search:
            self.output_processor.check_id_free(request_id, 1)
            return self.beam_searches.add(
                request_id, prompt, sampling_params, priority, cache_salt, arrival_time
            )
        self.output_processor.check_id_free(request_id, sampling_params.n)
        self.beam_searches.check_id_free(request_id)
        taken = self.input_processor.process(prompt, sampling_params, grammar)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        requests = [
            Request(
                request_id=sample_id,
                prompt_token_ids=taken.prompt_token_ids,
                sampling_params=params,
                eos_token_id=self.eos_token_id,
                arrival_time=arrival_time,
                priority=priority,
                cache_salt=cache_salt,
            )
            for sample_id, params in fan_out(request_id, taken.sampling_params)
        ]
        parent = self.output_processor.new_parent(request_id, taken, requests, arrival_time)
        spec = taken.sampling_params.structured_output
        first_id = requests[0].request_id

        def start(request: Request) -> None:
            if taken.grammar is not None:
                self.structured.add(request.request_id, taken.grammar, spec.starts_after_token_ids)
            # The other samples fork the first one's prompt blocks (engine/core/scheduler_forks.py).
            fork_of = None if request.request_id == first_id else first_id
            self.scheduler.add_request(request, fork_of=fork_of)

        self.output_processor.add_request(parent, start)
        return self.output_processor.make_output(parent)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults (vLLM's name)."""
        return SamplingParams(**self.generation_defaults.as_sampling_args())

    def abort_request(self, request_ids: Sequence[str]) -> None:
        now = time.monotonic()
        self.beam_searches.abort(request_ids)
        aborted = self.output_processor.abort(request_ids)
        if self.metrics is not None:
            for parent in aborted:
                self.metrics.request_finished(parent.times, "abort", now)
        sample_ids = [s.request.request_id for parent in aborted for s in parent.samples]
        if sample_ids:
            self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)
        if self.metrics is not None:
            self.metrics.maybe_flush(self.stats, idle=not self.has_unfinished_requests())

    def has_unfinished_requests(self) -> bool:
        return (
            bool(self.output_processor.parents)
            or self.beam_searches.active
            or self.scheduler.has_unfinished_requests()
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents) + len(self.beam_searches.searches)

    # -- one step -------------------------------------------------------------------------

    def batch_wait_left(self) -> float:
        """Seconds new requests are still held back for more arrivals to join them
        (batch_wait_timeout_ms; engine/core/batch_wait.py); 0: the next step admits them."""
        return self.scheduler.batch_wait_left(time.monotonic())

    def set_batch_wait_timeout_ms(self, timeout_ms: float) -> None:
        """Another dynamic batching timeout from the next step on (bench/batch_wait.py
        compares several on one engine); a rebuilt engine takes its config's again."""
        if not timeout_ms >= 0 or timeout_ms == float("inf"):
            raise ValueError(
                f"batch_wait_timeout_ms must be a finite number >= 0, got {timeout_ms}"
            )
        self.scheduler.batch_wait_timeout_s = timeout_ms / 1000

    def admission_steps(self) -> int:
        """Steps that admitted new requests so far (each starts their prompts)."""
        return self.scheduler.num_admitting_steps

    def has_admitted_work(self) -> bool:
        """A step has something to run besides requests waiting for admission."""
        return bool(self._pending or self.scheduler.running)

    def step(self, admit_new: bool = True) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the steps that completed.

        With an executor that can overlap, step t+1 is scheduled and launched before step
        t's tokens are read back, so the host's work hides behind the device's. With
        pipeline stages, up to one step per stage is in flight, each carrying other
        requests, so that every stage has work. `admit_new=False` admits no waiting request
        (the batch waits for more arrivals: `batch_wait_left`); a step left with nothing
        to run is not launched, and the steps in flight are read.
        """
        outputs: list[RequestOutput] = []
        # A structured request's next mask follows from its latest token, a beam search's
        # next beams from its latest logprobs: read them all first.
        max_pending = 0 if self.structured or self.beam_searches.active else self._max_pending()
        while len(self._pending) > max_pending:
            outputs += self._complete(*self._pending.popleft())
        scheduler_output = self.scheduler.schedule(admit_new)
        if self.structured:
            scheduler_output.grammar_bitmask = self._grammar_bitmasks(scheduler_output)
        if scheduler_output.is_empty and self._pending and not self.executor.supports_overlap:
            # Every runnable request waits for a step in flight: read that one, then schedule
            # again (this step's finished ids go to the workers with the next step).
            self.scheduler.defer_finished(scheduler_output)
            outputs += self._complete(*self._pending.popleft())
            scheduler_output = self.scheduler.schedule(admit_new)
        if scheduler_output.is_empty and not admit_new:
            # Only held requests wait: launch nothing, read what is in flight.
            self.scheduler.defer_finished(scheduler_output)
            while self._pending:
                outputs += self._complete(*self._pending.popleft())
            return self._drop_failed(outputs)
        if self.metrics is not None:
            self._record_scheduled(scheduler_output)
        self._pending.append(
            (scheduler_output, self.executor.execute_model_async(scheduler_output))
        )
        while len(self._pending) > max_pending:
            outputs += self._complete(*self._pending.popleft())
        return self._drop_failed(outputs)

    def _drop_failed(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        failed = self.output_processor.failed
        if failed:
            outputs = [o for o in outputs if o.request_id not in failed]
            self.abort_request([rid for rid in failed if rid in self.output_processor.parents])
        return outputs

    def _grammar_bitmasks(self, scheduler_output: SchedulerOutput) -> dict[str, np.ndarray]:
        """A mask for each structured request that samples in this step; a prompt chunk
        that does not reach the prompt's end samples nothing. Nothing is in flight (step()
        read it all), so a request samples now exactly when it holds a placeholder."""
        requests = self.scheduler.requests
        masks = {}
        for rid in scheduler_output.num_scheduled_tokens:
            if self.structured.constrains(rid) and requests[rid].num_output_placeholders:
                try:
                    masks[rid] = mask = self.structured.bitmask(rid)
                except Exception as e:  # it samples unconstrained, then is aborted
                    self.output_processor.fail(rid, e)
                    continue
                request = requests[rid]
                allowed = request.sampling_params.allowed_bitmask(self.vocab_size)
                if allowed is not None and not np.bitwise_and(mask, allowed).any():
                    problem = (
                        "allow none of the tokens the structured output allows after "
                        f"{request.num_output_tokens} output tokens"
                    )
                    self.output_processor.fail(rid, RequestInputError("allowed_token_ids", problem))
        return masks

    def take_failed(self) -> list[tuple[str, Exception]]:
        """The requests steps failed on their own since the last call (already aborted):
        their callers hear the error here, as no output of theirs will come."""
        return self.output_processor.take_failed()

    def _max_pending(self) -> int:
        """Steps that may stay in flight when step() returns."""
        overlap = self.executor.supports_overlap
        return max(self.executor.max_concurrent_batches, 2 if overlap else 1) - 1

    def _complete(self, scheduler_output: SchedulerOutput, launched: PendingOutput):
        runner_output = launched.result()
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        searched = (
            self.beam_searches.process(updated, runner_output) if self.beam_searches.active else []
        )
        outputs, touched = self.output_processor.process_outputs(updated, runner_output)
        outputs += searched
        if self.metrics is not None:
            self._record_step(scheduler_output, touched)
        return outputs

    def _record_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        now = time.monotonic()
        for new_req in scheduler_output.scheduled_new_reqs:
            parent = self.output_processor.parent_of(new_req.req_id)
            if parent is not None:
                self.metrics.request_scheduled(parent.times, now)

    def _record_step(
        self, scheduler_output: SchedulerOutput, touched: Iterable[ParentRequest]
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

    def stats(self) -> dict[str, float]:
        return self.scheduler.stats()

    def compile_grammar(self, spec: StructuredOutput) -> Future:
        """The grammar for `spec`, compiled on a thread while the engine steps on (a Future:
        its result goes to add_request; a schema that cannot be followed is a ValueError)."""
        return self.structured.compile_in_background(spec)

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
