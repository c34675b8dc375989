"""Engines that honour AsyncEngine's API without a model: `ScriptedEngine` emits a known token
sequence, `TextEngine` writes a given text. OpenAIServing runs over them in milliseconds."""

from __future__ import annotations

import asyncio
import json

from engine.api.protocol import ChatCompletionRequest, CompletionRequest
from engine.generation_config import GenerationDefaults
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from engine.sampling_params import RequestOutputKind

MAX_MODEL_LEN = 64
ANSWER = " one two three four five six seven eight nine ten"


class ScriptedEngine:
    """Generates ANSWER's tokens one step at a time (sample i shifted by i tokens). Prompt
    logprobs come with the first token, as the real engine's do (see `prompt_logprobs`)."""

    model_name = "scripted"
    served_model_names = ["scripted"]
    max_model_len = MAX_MODEL_LEN
    quantization = "none"
    generation_defaults = GenerationDefaults()

    def __init__(
        self,
        tokenizer,
        step_delay_s: float = 0.0,
        fail: BaseException | None = None,
        refuse: str | None = None,
        fail_at_step: int = 0,
    ):
        """`fail`: every request raises it (at its `fail_at_step`th token, 0: before it is
        taken); `refuse`: a prompt containing this text is refused (ValueError) as the engine
        refuses input it cannot serve."""
        self.tokenizer = tokenizer
        self.answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
        self.step_delay_s = step_delay_s
        self.fail = fail
        self.fail_at_step = fail_at_step
        self.refuse = refuse
        self.calls: list[dict] = []
        self.closed: list[str] = []
        self.num_requests = 0
        self.num_token_steps = 0

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    async def generate(self, prompt, sampling_params, request_id, priority=0, cache_salt=None):
        self.calls.append(
            dict(
                prompt=prompt,
                params=sampling_params,
                priority=priority,
                cache_salt=cache_salt,
                request_id=request_id,
            )
        )
        finished = False
        self.num_requests += 1
        try:
            if self.fail is not None and not self.fail_at_step:
                raise self.fail
            if self.refuse is not None and self.refuse in self.tokenizer.decode(prompt):
                raise ValueError(f"prompt contains {self.refuse!r}")
            every_output = sampling_params.output_kind != RequestOutputKind.FINAL_ONLY
            if every_output:  # taken: the first output has no tokens yet
                empty = [CompletionOutput(i, "", []) for i in range(sampling_params.n)]
                yield RequestOutput(request_id, None, list(prompt), empty, False)
            n_tokens = sampling_params.max_tokens
            prompt_logprobs = None
            if sampling_params.prompt_logprobs is not None:
                prompt_logprobs = self.prompt_logprobs(prompt, sampling_params.prompt_logprobs)
            for step in range(1, n_tokens + 1):
                await asyncio.sleep(self.step_delay_s)
                if step == self.fail_at_step:
                    raise self.fail
                self.num_token_steps += 1
                finished = step == n_tokens
                outputs = [
                    self._sample(i, step, sampling_params.logprobs, finished)
                    for i in range(sampling_params.n)
                ]
                if every_output or finished:
                    yield RequestOutput(
                        request_id,
                        None,
                        list(prompt),
                        outputs,
                        finished,
                        prompt_logprobs=prompt_logprobs,
                    )
        finally:
            self.num_requests -= 1
            if not finished:
                self.closed.append(request_id)

    def prompt_logprobs(self, prompt: list[int], top_n: int) -> list[TokenLogprobs | None]:
        """Position j's token is the likeliest (rank 1, logprob -j/10) at odd j; at even j it
        is outside the top-N (rank N + 2, logprob -5)."""
        vocab = len(self.tokenizer)
        entries: list[TokenLogprobs | None] = [None]
        for j, t in enumerate(prompt[1:], start=1):
            if j % 2:
                others = {(t + k) % vocab: -1.0 - k for k in range(1, top_n)}
                top = dict(list({t: -j / 10, **others}.items())[:top_n])
                entries.append(TokenLogprobs(t, -j / 10, 1, top))
            else:
                top = {(t + 1000 + k) % vocab: -0.5 - k for k in range(top_n)}
                entries.append(TokenLogprobs(t, -5.0, top_n + 2, top))
        return entries

    def _sample(self, index: int, step: int, logprobs: int | None, finished: bool):
        ids = (self.answer_ids * 3)[index : index + step]
        entries = None
        if logprobs is not None:
            entries = [
                TokenLogprobs(
                    t, -0.5, 1, {t: -0.5, **{t + k: -1.0 - k for k in range(1, logprobs)}}
                )
                for t in ids
            ]
        return CompletionOutput(
            index,
            self.tokenizer.decode(ids),
            ids,
            finish_reason="length" if finished else None,
            logprobs=entries,
        )


def scripted_chat(**fields) -> ChatCompletionRequest:
    """A chat request for the scripted model, with `fields` over a one-line user turn."""
    body = {"model": "scripted", "messages": [{"role": "user", "content": "Count"}], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def scripted_completion(**fields) -> CompletionRequest:
    """A completion request for the scripted model, with `fields` over a short prompt."""
    body = {"model": "scripted", "prompt": "Count:", **fields}
    return CompletionRequest.model_validate_json(json.dumps(body))


# A function tool, and a call of it as a Hermes-style model writes it.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class TextEngine:
    """Writes `text` (each of n samples alike) a token a step, then stops with
    `finish_reason` ("stop": a model ending its turn; "length": max_tokens reached), decoded
    as the request asks (skip_special_tokens)."""

    model_name = "scripted"
    served_model_names = ["scripted"]
    max_model_len = 512
    quantization = "none"
    generation_defaults = GenerationDefaults()

    def __init__(
        self, tokenizer, text: str, end_with_eos: bool = False, finish_reason: str = "stop"
    ):
        self.tokenizer = tokenizer
        self.finish_reason = finish_reason
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        if end_with_eos:
            self.ids.append(tokenizer.eos_token_id)
        self.calls: list[dict] = []
        self.num_requests = 0

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    async def generate(self, prompt, sampling_params, request_id, priority=0, cache_salt=None):
        self.calls.append(dict(prompt=prompt, params=sampling_params))
        every_output = sampling_params.output_kind != RequestOutputKind.FINAL_ONLY
        if every_output:
            empty = [CompletionOutput(i, "", []) for i in range(sampling_params.n)]
            yield RequestOutput(request_id, None, list(prompt), empty, False)
        for step in range(1, len(self.ids) + 1):
            await asyncio.sleep(0)
            finished = step == len(self.ids)
            outputs = [
                self._sample(i, step, sampling_params, finished) for i in range(sampling_params.n)
            ]
            if every_output or finished:
                yield RequestOutput(request_id, None, list(prompt), outputs, finished)

    def _sample(self, index, step, params, finished) -> CompletionOutput:
        ids = self.ids[:step]
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        logprobs = None
        if params.logprobs is not None:
            logprobs = [TokenLogprobs(t, -0.5, 1, {t: -0.5}) for t in ids]
        finish_reason = self.finish_reason if finished else None
        return CompletionOutput(index, text, ids, finish_reason, logprobs=logprobs)
