"""POST /v1/completions: one prompt or several (text or token ids), each with `n` choices,
optionally echoed back with its logprobs; the response whole or as a stream of chunks."""

from __future__ import annotations

import asyncio
import dataclasses

from engine.api.beam_search import as_beam_search, beam_width
from engine.api.errors import APIError
from engine.api.inputs import echo_only, prompt_param, to_sampling_params
from engine.api.protocol import CompletionRequest
from engine.api.render import CompletionFormat, completion_response
from engine.api.responses import CompletionResponse
from engine.api.serving_base import GeneratingEndpoint, RequestContext, SSEStream
from engine.api.stream import CompletionDeltaTracker
from engine.sampling_params import SamplingParams

OPENAI_DEFAULT_MAX_TOKENS = 16


class CompletionServing(GeneratingEndpoint):
    response_id_prefix = "cmpl"

    async def create_completion(
        self, request: CompletionRequest, ctx: RequestContext | None = None
    ) -> CompletionResponse | SSEStream:
        self.served.check_model(request.model)
        if request.use_beam_search:
            beam_width(request)  # a 400 before any prompt is encoded
        elif request.best_of not in (None, request.n):
            raise APIError(f"best_of must equal n ({request.n})", param="best_of")
        encoded = await self._encode_prompts(request)
        prompts = [
            self.served.checked_prompt(ids, request, prompt_param(request, i))
            for i, ids in enumerate(encoded)
        ]
        # A truncated prompt echoes as the tokens the model saw.
        truncated = any(len(a) != len(b) for a, b in zip(encoded, prompts, strict=True))
        fmt = CompletionFormat(
            logprobs=request.logprobs,
            echo=self._echo_texts(request.prompt, prompts, truncated) if request.echo else None,
            echo_only=echo_only(request),
            prompt_logprobs=request.prompt_logprobs,
            return_token_ids=request.return_token_ids,
        )
        params = [self._sampling_params(request, len(ids)) for ids in prompts]
        generation = await self._start(request, prompts, params, ctx or RequestContext())
        if request.stream:
            tracker = CompletionDeltaTracker(fmt=fmt, **self._tracker_fields(request, generation))
            return self._stream(request, generation, tracker, fmt.echo_only)
        final = await self._final_outputs(generation)
        if request.use_beam_search:  # best_of beams wide, the n best returned
            final = [dataclasses.replace(o, outputs=o.outputs[: request.n]) for o in final]
        return completion_response(
            generation.response_id,
            self.served.model_name,
            final,
            self._usage(generation, final, fmt.echo_only),
            self.served.token_text(request),
            fmt,
        )

    def _sampling_params(self, request: CompletionRequest, prompt_len: int) -> SamplingParams:
        # OpenAI's default of 16 yields to a long prompt (and to the model's own default);
        # an explicit max_tokens does not.
        if "max_tokens" in request.model_fields_set:
            max_tokens = request.max_tokens
        else:
            max_tokens = self.served.default_max_tokens(prompt_len, OPENAI_DEFAULT_MAX_TOKENS)
        params = to_sampling_params(
            request,
            prompt_len,
            self.served.max_model_len,
            max_tokens,
            "max_tokens",
            request.logprobs,
            defaults=self.served.generation_defaults.sampling,
        )
        return as_beam_search(params, request) if request.use_beam_search else params

    async def _encode_prompts(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if self.served.tokenizer is None and (
            isinstance(prompt, str) or isinstance(prompt[0], str)
        ):
            raise APIError(
                "this model has no tokenizer: send the prompt as token ids", param="prompt"
            )
        special = request.add_special_tokens
        if isinstance(prompt, str):
            return [await self.served.encode(prompt, special)]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], str):
            return list(await asyncio.gather(*(self.served.encode(p, special) for p in prompt)))
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [list(p) for p in prompt]

    def _echo_texts(
        self,
        prompt: str | list[str] | list[int] | list[list[int]],
        ids: list[list[int]],
        decode: bool = False,
    ) -> list[str]:
        """Each prompt's text as echo returns it: as given, token ids decoded (all decoded
        with `decode`)."""
        if isinstance(prompt, str) and not decode:
            return [prompt]
        if isinstance(prompt[0], str) and not decode:
            return list(prompt)
        if self.served.tokenizer is None:
            raise APIError(
                "echo needs a tokenizer to turn a token-id prompt into text, and this model "
                "has none",
                param="echo",
            )
        return [self.served.tokenizer.decode(p) for p in ids]
