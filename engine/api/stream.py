"""Engine outputs -> OpenAI SSE chunks.

Engine outputs are cumulative; a `DeltaTracker` remembers how much of each choice has been
sent, so a stream emits only the new text (and the logprobs of the new tokens).
"""

from __future__ import annotations

import json
from typing import Any

from engine.api.logprobs import TokenText, chat_logprobs, completion_logprobs
from engine.api.reasoning import ReasoningUse, reasoning_deltas
from engine.api.reasoning_parsers import ReasoningDelta, ReasoningParser
from engine.api.render import CompletionFormat, prompt_part, shown
from engine.api.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    PromptLogprob,
    UsageInfo,
)
from engine.api.tool_output import ToolCallDeltas
from engine.api.tools import ToolUse
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs

DONE = "data: [DONE]\n\n"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(body: dict) -> str:
    return sse(json.dumps(body))


class _Sent:
    __slots__ = (
        "text",
        "logprobs",
        "tokens",
        "offset",
        "finished",
        "started",
        "prompt_logprobs",
        "prompt_ids",
    )

    def __init__(self) -> None:
        self.text = 0
        self.logprobs = 0
        self.tokens = 0
        self.offset = 0
        self.finished = False
        self.started = False
        """A chat's role chunk, or a completion's prompt part (echo, prompt_logprobs), done."""
        self.prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
        """Waiting for the choice's first generated text, to go out with it."""
        self.prompt_ids: list[int] | None = None
        """return_token_ids: the prompt's ids, waiting for the choice's first chunk."""


class DeltaTracker:
    """Turns successive cumulative outputs into OpenAI stream chunks (as SSE text)."""

    chunk_cls: type[ChatCompletionChunk] | type[CompletionChunk]

    def __init__(
        self,
        *,
        response_id: str,
        created: int,
        model: str,
        n: int,
        include_usage: bool,
        token_text: TokenText,
    ) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model
        self.n = n
        self.include_usage = include_usage
        self.token_text = token_text
        self._sent: dict[int, _Sent] = {}
        self.usage: UsageInfo | None = None
        """Set by the caller: the usage so far, sent on every chunk (continuous_usage_stats)."""

    def chunks(self, output: RequestOutput, prompt_index: int = 0) -> str:
        """SSE events for what `output` adds to what was already sent ("" for nothing)."""
        events = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            sent = self._sent.get(index)
            if sent is None:
                sent = self._sent[index] = _Sent()
            if not sent.finished:
                events.extend(self._choice_events(index, prompt_index, output, completion, sent))
        return "".join(events)

    def usage_chunk(self, usage: UsageInfo) -> str:
        chunk = self.chunk_cls(
            id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage
        )
        return sse(chunk.model_dump_json())

    def _choice_events(
        self,
        index: int,
        prompt_index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        sent: _Sent,
    ) -> list[str]:
        raise NotImplementedError

    def _advance(
        self, completion: CompletionOutput, sent: _Sent, with_logprobs: bool
    ) -> tuple[str, list[TokenLogprobs] | None] | None:
        """The text (and, `with_logprobs`, the logprob entries) `completion` adds to what
        was sent, now counted as sent; None when it adds no text and has not finished."""
        text = completion.text[sent.text :]
        if not text and completion.finish_reason is None:
            return None
        sent.text += len(text)
        new = None
        if with_logprobs and completion.logprobs is not None:
            new = completion.logprobs[sent.logprobs :]
            sent.logprobs += len(new)
        return text, new

    @staticmethod
    def _new_ids(completion: CompletionOutput, sent: _Sent) -> list[int]:
        """The generated ids since the choice's last chunk, now counted as sent."""
        new = completion.token_ids[sent.tokens :]
        sent.tokens += len(new)
        return list(new)

    def _event(self, choice: ChatChunkChoice | CompletionChoice, **fields: Any) -> str:
        chunk = self.chunk_cls(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=self.usage,
            **fields,
        )
        # OpenAI sends "usage": null on every chunk only when the client asked for usage.
        exclude = None if self.include_usage else {"usage"}
        return sse(chunk.model_dump_json(exclude=exclude))


class ChatDeltaTracker(DeltaTracker):
    """With `reasoning`, each choice's text is split into the model's thought (reasoning
    deltas) and its content; with `tools`, the content is read for tool calls. A delta's
    logprobs are then those of the tokens since the last delta (text a parser holds back
    keeps its tokens' logprobs until it goes out, or to the finish chunk)."""

    chunk_cls = ChatCompletionChunk

    def __init__(
        self,
        *,
        with_logprobs: bool,
        tools: ToolUse | None = None,
        reasoning: ReasoningUse | None = None,
        return_token_ids: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.with_logprobs = with_logprobs
        self.return_token_ids = return_token_ids
        self._prompt_ids: list[int] | None = None
        """return_token_ids: the prompt's ids, waiting for the stream's first chunk."""
        self._prompt_ids_sent = False
        self._ids_of: tuple[CompletionOutput, _Sent] | None = None
        """The choice whose new token ids the next chunk carries (none for a role chunk)."""
        self.tools = tools
        self.reasoning = reasoning
        self._tool_deltas: dict[int, ToolCallDeltas] = {}
        self._reasoning_parsers: dict[int, ReasoningParser] = {}
        self._held_logprobs: dict[int, list[TokenLogprobs]] = {}

    def _choice_events(
        self,
        index: int,
        prompt_index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        sent: _Sent,
    ) -> list[str]:
        events = []
        self._ids_of = None
        if self.return_token_ids and not self._prompt_ids_sent:
            self._prompt_ids_sent = True
            self._prompt_ids = output.prompt_token_ids
        if not sent.started:
            sent.started = True
            events.append(self._chat_event(index, {"role": "assistant", "content": ""}))
        self._ids_of = completion, sent
        advanced = self._advance(completion, sent, self.with_logprobs)
        if advanced is None:
            return events
        text, new = advanced
        finish = completion.finish_reason
        if self.tools is not None or self.reasoning is not None:
            events.extend(self._parsed_events(index, text, new, finish))
            sent.finished = finish is not None
            return events
        logprobs = None if new is None else chat_logprobs(new, self.token_text)
        if text or logprobs is not None:
            events.append(self._chat_event(index, {"content": text}, logprobs=logprobs))
        if finish is not None:
            events.append(self._chat_event(index, {}, finish_reason=finish))
        sent.finished = finish is not None
        return events

    def _parsed_events(
        self, index: int, text: str, new: list[TokenLogprobs] | None, finish: str | None
    ) -> list[str]:
        """The deltas of text read by the reasoning parser, then the content by the tool
        parser (either may be absent)."""
        held = self._held_logprobs.setdefault(index, [])
        held.extend(new or ())
        deltas: list[dict[str, Any]] = []
        content = text
        if self.reasoning is not None:
            split = self._split_reasoning(index, text, finish)
            deltas += reasoning_deltas(split)
            content = split.content
        reader = None
        if self.tools is not None:
            reader = self._tool_deltas.get(index)
            if reader is None:
                reader = self._tool_deltas[index] = ToolCallDeltas(self.tools)
            deltas += reader.deltas(content, finish)
        elif content:
            deltas.append({"content": content})
        events = [
            self._chat_event(index, delta, logprobs=self._take_logprobs(held)) for delta in deltas
        ]
        if finish is not None:
            reason = finish if reader is None else reader.finish_reason(finish)
            events.append(
                self._chat_event(
                    index, {}, logprobs=self._take_logprobs(held), finish_reason=reason
                )
            )
        return events

    def _split_reasoning(self, index: int, text: str, finish: str | None) -> ReasoningDelta:
        parser = self._reasoning_parsers.get(index)
        if parser is None:
            parser = self._reasoning_parsers[index] = self.reasoning.new_parser()
        split = parser.feed(text)
        if finish is None:
            return split
        end = parser.finish()
        return ReasoningDelta(split.reasoning + end.reasoning, split.content + end.content)

    def _take_logprobs(self, held: list[TokenLogprobs]) -> ChatLogprobs | None:
        if not held:
            return None
        logprobs = chat_logprobs(held, self.token_text)
        held.clear()
        return logprobs

    def _chat_event(
        self,
        index: int,
        delta: dict,
        logprobs: ChatLogprobs | None = None,
        finish_reason: str | None = None,
    ) -> str:
        token_ids = None
        if self.return_token_ids:
            token_ids = [] if self._ids_of is None else self._new_ids(*self._ids_of)
        prompt_ids, self._prompt_ids = self._prompt_ids, None
        return self._event(
            ChatChunkChoice(
                index=index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=finish_reason,
                token_ids=token_ids,
            ),
            prompt_token_ids=prompt_ids,
        )


class CompletionDeltaTracker(DeltaTracker):
    """A choice's prompt part (echo, vLLM's prompt_logprobs) goes out before its generated
    text: at once, or where it shows the prompt's logprobs, once the engine gave them (with
    the first generated token)."""

    chunk_cls = CompletionChunk

    def __init__(self, *, fmt: CompletionFormat, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fmt = fmt

    def _choice_events(
        self,
        index: int,
        prompt_index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        sent: _Sent,
    ) -> list[str]:
        events = []
        if not sent.started:
            # An engine that ends a request early (abort) may never give the prompt's logprobs.
            waiting = self.fmt.shows_prompt_logprobs and output.prompt_logprobs is None
            if waiting and completion.finish_reason is None:
                return events
            sent.started = True
            prompt = prompt_part(self.fmt, prompt_index, output, self.token_text)
            ids = self.fmt.return_token_ids
            if self.fmt.echo is None:
                sent.prompt_logprobs = prompt.prompt_logprobs
                sent.prompt_ids = output.prompt_token_ids if ids else None
            else:
                events.append(
                    self._event(
                        CompletionChoice(
                            index=index,
                            text=prompt.text,
                            logprobs=prompt.logprobs,
                            prompt_logprobs=prompt.prompt_logprobs,
                            prompt_token_ids=output.prompt_token_ids if ids else None,
                            token_ids=[] if ids else None,
                        )
                    )
                )
                sent.offset = len(prompt.text)
        completion = shown(self.fmt, completion)
        advanced = self._advance(completion, sent, self.fmt.logprobs is not None)
        if advanced is None:
            return events
        text, new = advanced
        finish = completion.finish_reason
        logprobs = None
        if new is not None:
            logprobs = completion_logprobs(new, self.token_text, sent.offset)
            sent.offset += sum(len(token) for token in logprobs.tokens)
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=finish,
            prompt_logprobs=sent.prompt_logprobs,
            prompt_token_ids=sent.prompt_ids,
            token_ids=self._new_ids(completion, sent) if self.fmt.return_token_ids else None,
        )
        events.append(self._event(choice))
        sent.prompt_logprobs = sent.prompt_ids = None
        sent.finished = finish is not None
        return events
