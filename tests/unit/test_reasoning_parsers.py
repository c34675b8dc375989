"""Reasoning parsers on hand-written model outputs: whole, and streamed cut at every point
(and into single characters): the deltas join back to the whole-text split, and a tag cut
in two never shows."""

from __future__ import annotations

import pytest

from engine.api.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    extract_reasoning,
    prompt_reasoning,
)

THOUGHT = "The user wants 2 + 2. <b>4</b>, surely; not </thin or <th."

# (output, (reasoning, content)) per parser, the prompt leaving the thought to the output.
DEEPSEEK = [
    (f"{THOUGHT}</think>\n\nIt is 4.", (THOUGHT, "\n\nIt is 4.")),
    (f"<think>\n{THOUGHT}</think>It is 4.", (f"\n{THOUGHT}", "It is 4.")),
    (f"  <think>{THOUGHT}</think>", (THOUGHT, None)),
    (f"{THOUGHT}", (THOUGHT, None)),  # cut short: all of it a thought
    ("</think>It is 4.", (None, "It is 4.")),
    ("It is 4.</think> <think>again</think>", ("It is 4.", " <think>again</think>")),
    ("<thin", ("<thin", None)),
    ("", (None, None)),
]
QWEN3 = [
    (f"<think>\n{THOUGHT}\n</think>\n\nIt is 4.", (f"\n{THOUGHT}\n", "\n\nIt is 4.")),
    (f"\n<think>{THOUGHT}</think>It is 4.", (THOUGHT, "It is 4.")),
    ("<think></think>It is 4.", (None, "It is 4.")),
    (f"<think>{THOUGHT}", (THOUGHT, None)),  # a thought cut short
    ("It is 4.", (None, "It is 4.")),  # no thought opened: all content
    ("It is 4. <think>x</think> y", (None, "It is 4. <think>x</think> y")),
    ("It is 4.</think>", (None, "It is 4.</think>")),
    ("<thin", (None, "<thin")),
    ("  ", (None, "  ")),
    ("", (None, None)),
]
CASES = [(DeepSeekR1ReasoningParser, *case) for case in DEEPSEEK] + [
    (Qwen3ReasoningParser, *case) for case in QWEN3
]


def _streamed(parser, pieces: list[str]) -> tuple[str, str, list]:
    reasoning = content = ""
    deltas = []
    for piece in pieces:
        delta = parser.feed(piece)
        deltas.append(delta)
        reasoning += delta.reasoning
        content += delta.content
    end = parser.finish()
    deltas.append(end)
    return reasoning + end.reasoning, content + end.content, deltas


@pytest.mark.parametrize(("cls", "text", "expected"), CASES)
def test_whole_output_splits_into_reasoning_and_content(cls, text, expected):
    assert extract_reasoning(cls(), text) == expected


@pytest.mark.parametrize(("cls", "text", "expected"), CASES)
def test_every_split_of_a_stream_joins_back_to_the_whole_split(cls, text, expected):
    whole = tuple(part or "" for part in expected)
    for cut in range(len(text) + 1):
        reasoning, content, _ = _streamed(cls(), [text[:cut], text[cut:]])
        assert (reasoning, content) == whole, cut
    reasoning, content, deltas = _streamed(cls(), list(text))
    assert (reasoning, content) == whole
    for delta in deltas:  # no delta shows a piece of a tag the output used as one
        for shown in (delta.reasoning, delta.content):
            assert shown not in ("<", "</", "</th", "<th") or shown in whole[1]


def test_a_partial_tag_is_held_back_until_the_text_tells():
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("Thinking </th").reasoning == "Thinking "
    delta = parser.feed("ink>The answer")
    assert (delta.reasoning, delta.content) == ("", "The answer")
    parser = DeepSeekR1ReasoningParser()
    parser.feed("a </th")
    assert parser.feed("e end").reasoning == "</the end"  # not a tag after all
    parser = Qwen3ReasoningParser()
    assert parser.feed("<thi") == parser.feed("")  # nothing out: it may still open a thought
    delta = parser.feed("nk>x")
    assert (delta.reasoning, delta.content) == ("x", "")
    parser = Qwen3ReasoningParser()
    parser.feed("<thi")
    assert parser.feed("s is it").content == "<this is it"


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_a_prompt_that_ended_the_thought_leaves_all_content(name):
    cls = REASONING_PARSERS[name]
    text = "Sure.</think> <think>x"
    assert extract_reasoning(cls("ended"), text) == (None, text)
    assert extract_reasoning(cls("open"), "a</think>b") == ("a", "b")
    assert extract_reasoning(cls("open"), "<think>a</think>b") == ("a", "b")


def test_the_prompts_tail_tells_an_opened_or_ended_thought():
    assert prompt_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "ended"
    assert prompt_reasoning("<|im_start|>assistant\n<think>\n") == "open"
    assert prompt_reasoning("<|im_start|>assistant\n") is None
    assert prompt_reasoning("<think>a</think> then more") is None
