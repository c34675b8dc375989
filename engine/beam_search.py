"""Beam search inside the engine: beams are scheduler requests that fork one another's KV.

Why in the engine, not in a driver. vLLM's driver-level beam search sends, every step, one
one-token request per beam with the whole sequence as its prompt and counts on the prefix
cache to find the KV again: without prefix caching every step recomputes every beam, and
the last partial block is recomputed even with it. Here a beam is a `Request` that lives
for one step: it computes one token and offers its 2W best next tokens (the sampler's
logprobs, of the model's own distribution); once every live beam of the search has
offered, `BeamGroup.select` (engine/core/beam_group.py: transformers' choices) picks the
next beams, each a new request forked from its parent (`Scheduler.fork_request`: the
parent's blocks shared, its last partial block copied only where two children write into
it), and the parents finish, freeing what no child holds. A beam that dies frees its
blocks; a prompt is computed once for all the beams. The token a beam's step sampled
(greedy) is taken back from it: the children carry the chosen tokens, and a beam that
waits for the others of its search (split across steps by the budget) is not scheduled.
Steps run one at a time while a search is live (`active`): the next beams are known only
once a step's logprobs are read.

Stopping: transformers' `early_stopping` modes; the default is "never", which is what
vLLM's beam search does (it runs to max_tokens and ranks every finished and live beam at
the end): with "never" the search stops only when no live beam can beat the W finished
ones, so the best sequences are those of a search run to its last token. Two things follow
transformers rather than vLLM: a sequence's length in its score counts generated tokens
only (vLLM's counts the prompt too), and a sequence that ends with EOS counts only if it
ranks among a step's W best candidates.

Sampling fields a beam search does not read (temperature, top_p, ...) are ignored with a
logged warning. Outputs come only when the search ends (`RequestOutput`, finished), with
`cumulative_logprob` on each sequence.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from engine.beam_search_fields import beam_search_ignored_fields
from engine.core.beam_group import BeamGroup, BeamOffer, EarlyStopping, normalized_score
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput
from engine.input_processor import InputProcessor
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import (
    MAX_LOGPROBS,
    RequestInputError,
    RequestOutputKind,
    SamplingParams,
)

logger = logging.getLogger(__name__)


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams` for `LLM.beam_search`, plus transformers' early_stopping."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    """Only 0: the search ranks the model's own logprobs."""
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = "never"
    include_stop_str_in_output: bool = False

    def to_sampling_params(self) -> SamplingParams:
        if self.temperature != 0:
            raise ValueError(
                f"temperature must be 0 for a beam search here, got {self.temperature!r}"
            )
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool):
            raise ValueError(f"beam_width must be an int, got {self.beam_width!r}")
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(
                f"beam_width must be in [1, {MAX_LOGPROBS // 2}], got {self.beam_width}"
            )
        return SamplingParams(
            n=self.beam_width,
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            use_beam_search=True,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )


@dataclass
class BeamSearchSequence:
    """As vLLM's: `tokens` are the prompt's then the generated ones, `text` their text."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float
    """cum_logprob / (generated tokens) ** length_penalty: what the sequences are ranked by."""
    finish_reason: str
    num_prompt_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
    """Best first."""


@dataclass
class _Beam:
    request: Request
    cum_logprob: float
    next_tokens: list[tuple[int, float]] | None = None
    """Its offer, once its step ran."""


@dataclass
class _Search:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    beam_params: SamplingParams
    group: BeamGroup
    live: list[_Beam] = field(default_factory=list)
    ids: Any = field(default_factory=itertools.count)


class BeamSearches:
    """The engine's live beam searches (`LLMEngine.add_request` with use_beam_search)."""

    def __init__(
        self,
        scheduler: Scheduler,
        input_processor: InputProcessor,
        tokenizer: Any | None,
        eos_token_ids: list[int],
    ):
        self.scheduler = scheduler
        self.input_processor = input_processor
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.searches: dict[str, _Search] = {}
        self._search_of: dict[str, str] = {}
        """A beam's request id -> its search's."""

    @property
    def active(self) -> bool:
        return bool(self.searches)

    def check_id_free(self, request_id: str) -> None:
        if request_id in self.searches or request_id in self._search_of:
            raise ValueError(f"request_id {request_id!r} is already in use (a beam search)")

    def add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> RequestOutput:
        self.check_id_free(request_id)
        ignored = beam_search_ignored_fields(params)
        if ignored:
            logger.warning("beam search %s ignores %s", request_id, ", ".join(ignored))
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        num_candidates = max(2, 1 + len(eos)) * params.n
        if num_candidates > MAX_LOGPROBS:
            raise RequestInputError(
                "n", f"(the beam width) needs {num_candidates} logprobs, over {MAX_LOGPROBS}"
            )
        beam_params = SamplingParams(
            temperature=0.0,
            max_tokens=None,
            ignore_eos=True,  # the search decides where a sequence ends
            logprobs=num_candidates,
            skip_special_tokens=params.skip_special_tokens,
            truncate_prompt_tokens=params.truncate_prompt_tokens,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        taken = self.input_processor.process(prompt, beam_params)
        prompt_ids = taken.prompt_token_ids
        # A sequence ends at max_tokens, at max_model_len, or where the whole cache is full.
        room = min(self.scheduler.max_model_len, self.scheduler.kv_cache_manager.max_num_tokens)
        max_tokens = room - len(prompt_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        group = BeamGroup(params.n, max_tokens, eos, params.length_penalty, params.early_stopping)
        search = _Search(request_id, taken.prompt, prompt_ids, params, taken.sampling_params, group)
        first = self._new_beam(search, [], priority, cache_salt, arrival_time)
        self.scheduler.add_request(first)
        search.live.append(_Beam(first, 0.0))
        self.searches[request_id] = search
        outputs = [CompletionOutput(i, "", []) for i in range(params.n)]
        return RequestOutput(request_id, taken.prompt, prompt_ids, outputs, finished=False)

    def _new_beam(
        self,
        search: _Search,
        token_ids: list[int],
        priority: int,
        cache_salt: str | None,
        arrival_time: float | None,
    ) -> Request:
        beam = Request(
            request_id=f"{search.request_id}#beam{next(search.ids)}",
            prompt_token_ids=search.prompt_token_ids,
            sampling_params=search.beam_params,
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
        )
        beam.append_output_token_ids(token_ids)
        self._search_of[beam.request_id] = search.request_id
        return beam

    def process(
        self, updated: list[Request], runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Take the offers of the beams a step computed; the searches that ended."""
        outputs = []
        for request in updated:
            search = self.searches.get(self._search_of.get(request.request_id, ""))
            if search is None:
                continue
            beam = next(b for b in search.live if b.request is request)
            if not request.is_finished:
                # Take the greedy token back: the children carry the chosen ones.
                request.output_token_ids.pop()
                request.all_token_ids.pop()
            if beam.next_tokens is not None:
                continue  # computed again after a preemption: it already offered
            logprobs = runner_output.logprobs[request.request_id]
            beam.next_tokens = list(logprobs.top.items())
            if all(b.next_tokens is not None for b in search.live):
                output = self._advance(search)
                if output is not None:
                    outputs.append(output)
        return outputs

    def _advance(self, search: _Search) -> RequestOutput | None:
        num_generated = search.group.num_generated
        parents = search.live
        offers = [
            BeamOffer(b.request.output_token_ids[:num_generated], b.cum_logprob, b.next_tokens)
            for b in parents
        ]
        chosen = search.group.select(offers)
        search.live = []
        for continuation in chosen:
            parent = parents[continuation.parent].request
            tokens = [*parent.output_token_ids[:num_generated], continuation.token_id]
            child = self._new_beam(
                search, tokens, parent.priority, parent.cache_salt, parent.arrival_time
            )
            self.scheduler.fork_request(parent, child)
            search.live.append(_Beam(child, continuation.cum_logprob))
        # After the forks: a parent's blocks stay with the children that hold them.
        self._finish([b.request for b in parents])
        if not search.group.done:
            return None
        del self.searches[search.request_id]
        return self._final_output(search)

    def _finish(self, beams: list[Request]) -> None:
        ids = [b.request_id for b in beams]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_STOPPED)
        for rid in ids:
            self._search_of.pop(rid, None)

    def _final_output(self, search: _Search) -> RequestOutput:
        outputs = []
        for i, hypothesis in enumerate(search.group.finished[: search.params.n]):
            ids = hypothesis.token_ids
            text_ids = ids[:-1] if hypothesis.ended_by_eos else ids
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=self._decode(text_ids, search.params.skip_special_tokens),
                    token_ids=list(ids),
                    finish_reason="stop" if hypothesis.ended_by_eos else "length",
                    cumulative_logprob=hypothesis.cum_logprob,
                )
            )
        return RequestOutput(
            search.request_id, search.prompt, search.prompt_token_ids, outputs, finished=True
        )

    def _decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Stop these searches (other ids are skipped); the ids of those that were."""
        aborted = []
        for rid in request_ids:
            search = self.searches.pop(rid, None)
            if search is not None:
                self._finish([b.request for b in search.live])
                aborted.append(rid)
        return aborted


def to_beam_search_output(
    output: RequestOutput, tokenizer: Any | None, length_penalty: float
) -> BeamSearchOutput:
    """A finished search's output in `LLM.beam_search`'s form (vLLM's)."""
    prompt_ids = output.prompt_token_ids
    sequences = []
    for c in output.outputs:
        tokens = [*prompt_ids, *c.token_ids]
        text_ids = tokens[:-1] if c.finish_reason == "stop" else tokens  # no EOS in text
        sequences.append(
            BeamSearchSequence(
                tokens=tokens,
                text="" if tokenizer is None else tokenizer.decode(text_ids),
                cum_logprob=c.cumulative_logprob,
                score=normalized_score(c.cumulative_logprob, len(c.token_ids), length_penalty),
                finish_reason=c.finish_reason,
                num_prompt_tokens=len(prompt_ids),
            )
        )
    return BeamSearchOutput(sequences)
