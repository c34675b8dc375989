"""The request path that chat completions and completions share: what the front end decided
about a request (`RequestContext`), starting its prompts on the engine, gathering their final
outputs for a whole response, and streaming them as SSE text (`SSEStream`).

A request is started once the engine has taken it (its response can start while the prompt
is computed). Anything wrong before that raises `APIError`; problems after it (a time limit,
the engine stopping) arrive in a stream as an SSE error event.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from engine.api.errors import APIError
from engine.api.inputs import prompt_param, structured_output_param
from engine.api.output_streams import TimeLimit, merge_streams, next_output
from engine.api.protocol import ChatCompletionRequest, CompletionRequest
from engine.api.render import usage_of
from engine.api.responses import UsageInfo
from engine.api.served_model import ServedModel
from engine.api.stream import DONE, DeltaTracker, sse_error
from engine.api.tools import ToolUse
from engine.outputs import RequestOutput
from engine.sampling_params import RequestInputError, SamplingParams
from engine.tenants import prefix_cache_salt


@dataclass
class RequestContext:
    """What the front end decided about a request before it reached the engine."""

    request_id: str | None = None
    """The client's id of the request (its X-Request-Id): response ids are made of it."""
    priority: int = 0
    """The tenant's priority: a request may ask for a larger (later) value, never smaller."""
    cache_salt: str | None = None
    """Prefix-cache salt: requests only share cached blocks with the same salt."""
    deadline: float | None = None
    """Wall-clock time (time.time()) after which the request is aborted with a 408."""


@dataclass
class SSEStream:
    events: AsyncIterator[str] = field(init=False)
    prompt_tokens: int = 0
    usage: UsageInfo = field(default_factory=UsageInfo)
    """Filled in when the stream ends (for per-tenant token accounting)."""


@dataclass
class Generation:
    """A request the engine has taken: its first output is in hand."""

    response_id: str
    outputs: AsyncIterator[tuple[int, RequestOutput]]
    """(prompt index, output) of all the request's prompts, merged."""
    first: tuple[int, RequestOutput]
    limit: TimeLimit
    prompt_lens: list[int]


class GeneratingEndpoint:
    """Base of an endpoint that generates: each request's prompts go through `_start`, and
    its outputs come back whole (`_final_outputs`) or as a stream (`_stream`)."""

    response_id_prefix: str
    """Response ids are this prefix, then the client's id of the request or a random one."""

    def __init__(self, served: ServedModel) -> None:
        self.served = served

    async def _start(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        params: list[SamplingParams],
        ctx: RequestContext,
        tools: ToolUse | None = None,
    ) -> Generation:
        """Hands each prompt to the engine and waits for the first output; `tools`: what a
        chat's tools ask of it (they name a structured output's field in errors)."""
        response_id = f"{self.response_id_prefix}-{ctx.request_id or uuid.uuid4().hex}"
        # A client's id may come again while its first request runs (a retry): the engine's
        # ids stay unique.
        engine_id = response_id if ctx.request_id is None else f"{response_id}-{uuid.uuid4().hex}"
        priority = ctx.priority if request.priority is None else max(ctx.priority, request.priority)
        salt = prefix_cache_salt(ctx.cache_salt, request.cache_salt)
        gens = [
            self._generate(ids, sp, f"{engine_id}-{i}", priority, salt, prompt_param(request, i))
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        limit = TimeLimit(ctx.deadline)
        outputs = merge_streams(gens)
        # A grammar that does not compile fails the first output: name the field it came in.
        structured = structured_output_param(request, tools)
        try:
            first = await next_output(outputs, limit, structured)
        except BaseException:
            limit.cancel()
            await outputs.aclose()
            raise
        prompt_lens = [len(ids) for ids in prompts]
        return Generation(response_id, outputs, first, limit, prompt_lens)

    async def _generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int,
        cache_salt: str | None,
        prompt_field: str,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt; input the engine refuses (a token id past
        the vocabulary) is an APIError naming the request's field, the prompt's as
        `prompt_field`."""
        outputs = self.served.engine.generate(prompt, params, request_id, priority, cache_salt)
        async with aclosing(outputs):
            try:
                async for output in outputs:
                    yield output
            except RequestInputError as e:
                field = prompt_field if e.field == "prompt" else e.field
                raise APIError(f"{field} {e.problem}", param=field) from None

    async def _final_outputs(self, generation: Generation) -> list[RequestOutput]:
        """Each prompt's final output, in the order of the prompts."""
        async with aclosing(generation.outputs):
            finals: dict[int, RequestOutput] = {}
            item = generation.first
            try:
                while item is not None:
                    finals[item[0]] = item[1]
                    item = await next_output(generation.outputs, generation.limit)
            finally:
                generation.limit.cancel()
        return [finals[i] for i in range(len(generation.prompt_lens))]

    def _usage(
        self, generation: Generation, outputs: list[RequestOutput], echo_only: bool = False
    ) -> UsageInfo:
        """Usage of the request's prompts and `outputs`; `echo_only`: a completion that only
        echoes its prompt (it counts no generated token)."""
        details = self.served.prompt_tokens_details
        return usage_of(generation.prompt_lens, outputs, echo_only, details)

    def _tracker_fields(
        self, request: CompletionRequest | ChatCompletionRequest, generation: Generation
    ) -> dict[str, Any]:
        """What every DeltaTracker of the request's stream is built with."""
        options = request.stream_options
        return dict(
            response_id=generation.response_id,
            created=int(time.time()),
            model=self.served.model_name,
            n=request.n,
            include_usage=options is not None and options.include_usage,
            token_text=self.served.token_text(request),
        )

    def _stream(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        generation: Generation,
        tracker: DeltaTracker,
        echo_only: bool = False,
    ) -> SSEStream:
        """The request's outputs as SSE text, chunked by `tracker` (built with
        `_tracker_fields`); `echo_only` as in `_usage`."""
        include_usage = tracker.include_usage
        continuous = include_usage and request.stream_options.continuous_usage_stats
        outputs, limit = generation.outputs, generation.limit
        result = SSEStream(prompt_tokens=sum(generation.prompt_lens))

        async def events() -> AsyncIterator[str]:
            latest: dict[int, RequestOutput] = {}
            async with aclosing(outputs):
                item = generation.first
                try:
                    while item is not None:
                        i, output = item
                        latest[i] = output
                        if continuous:
                            tracker.usage = self._usage(
                                generation, list(latest.values()), echo_only
                            )
                        text = tracker.chunks(output, prompt_index=i)
                        if text:
                            yield text
                        item = await next_output(outputs, limit)
                except APIError as e:
                    yield sse_error(e.to_response().model_dump())
                    yield DONE
                    return
                finally:
                    limit.cancel()
            result.usage = self._usage(generation, list(latest.values()), echo_only)
            if include_usage:
                yield tracker.usage_chunk(result.usage)
            yield DONE

        result.events = events()
        return result
