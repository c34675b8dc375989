"""A chat's reasoning: how the server's reasoning_parser splits its output (`ReasoningUse`),
and what that asks of a structured output (its grammar starts after the thought)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.api.reasoning_parsers import (
    END,
    PromptReasoning,
    ReasoningDelta,
    ReasoningParser,
    extract_reasoning,
    prompt_reasoning,
)
from engine.sampling_params import StructuredOutput
from engine.tokenizer import encode_text

PROMPT_TAIL_TOKENS = 24
"""Prompt tokens decoded to tell whether the template opened or ended the thought: enough
for `</think>` spelled out in single characters and the whitespace after it."""


@dataclass(frozen=True)
class ReasoningUse:
    parser: type[ReasoningParser]
    prompt: PromptReasoning
    """What the prompt did to the thought (opened it, ended it, neither)."""
    end_token_ids: tuple[int, ...]
    """`</think>` as the model's tokens."""

    def new_parser(self) -> ReasoningParser:
        return self.parser(self.prompt)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output, each None when empty."""
        return extract_reasoning(self.new_parser(), text)

    def structured_output(self, spec: StructuredOutput | None) -> StructuredOutput | None:
        """`spec` as the engine follows it: from the token after the thought, as vLLM does
        with a reasoning parser (the thought is free), unless the prompt ended it."""
        if spec is None or self.prompt == "ended":
            return spec
        return dataclasses.replace(spec, starts_after_token_ids=self.end_token_ids)


def end_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """`</think>` as the model's tokens (ReasoningUse.end_token_ids)."""
    return tuple(encode_text(tokenizer, END))


def reasoning_use(
    parser: type[ReasoningParser] | None,
    tokenizer: Any,
    prompt_ids: list[int],
    end_ids: tuple[int, ...],
) -> ReasoningUse | None:
    """How a chat of prompt `prompt_ids` reads its output (None: no reasoning parser);
    `end_ids`: `end_token_ids(tokenizer)`, computed once per server."""
    if parser is None:
        return None
    tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return ReasoningUse(parser, prompt_reasoning(tail), end_ids)


def reasoning_deltas(split: ReasoningDelta) -> list[dict[str, str]]:
    """A stream's reasoning delta, in both of vLLM's names (reasoning, reasoning_content)."""
    if not split.reasoning:
        return []
    return [{"reasoning": split.reasoning, "reasoning_content": split.reasoning}]
