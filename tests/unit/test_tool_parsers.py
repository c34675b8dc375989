"""Tool-call parsers on hand-written model outputs: whole, and streamed in random pieces."""

from __future__ import annotations

import json
import random

import pytest

from engine.api.tool_parsers import (
    TOOL_CALL_PARSERS,
    CallArguments,
    CallBroken,
    CallStart,
    Content,
    ExtractedToolCalls,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStream,
    extract_tool_calls,
)

WEATHER = '{"city": "Paris", "unit": "c"}'
# Braces, brackets, quotes and the closing tag inside strings are the call's own text.
TRICKY = '{"q": "a } ] \\" </tool_call> [TOOL_CALLS] ;", "n": [1, -2.5e3, {"x": null}], "t": true}'

HERMES = [
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', None,
     [("get_weather", WEATHER)]),
    (f'Let me look.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
     f'<tool_call>\n{{"arguments": {TRICKY}, "name": "search"}}\n</tool_call>\n',
     "Let me look.", [("get_weather", WEATHER), ("search", TRICKY)]),
    ('<tool_call>{"name": "now", "arguments": {}}</tool_call> It is late.', " It is late.",
     [("now", "{}")]),
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    ('No call here: 1 < 2 and <b>bold</b>, <tool_ca', "No call here: 1 < 2 and <b>bold</b>, <tool_ca", []),
    ('<tool_call>{"name": 7, "arguments": {}}</tool_call> after',
     '<tool_call>{"name": 7, "arguments": {}}</tool_call> after', []),
    ('<tool_call>not json</tool_call>', "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', '<tool_call>{"arguments": {"a": 1}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {"a": Paris}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"a": Paris}}</tool_call>', []),
]  # fmt: skip

LLAMA = [
    (f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
    (f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "search", '
     f'"parameters": {TRICKY}}}', None, [("get_weather", WEATHER), ("search", TRICKY)]),
    ('  {"name": "now", "arguments": {}}\n', None, [("now", "{}")]),
    ('The weather is {"sunny": true}.', 'The weather is {"sunny": true}.', []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
]  # fmt: skip

MISTRAL = [
    (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}]', None,
     [("get_weather", WEATHER)]),
    (f'Sure.[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
     f'{{"name": "search", "arguments": {TRICKY}}}]', "Sure.",
     [("get_weather", WEATHER), ("search", TRICKY)]),
    ("Plain [answer] with [TOOL_CALL", "Plain [answer] with [TOOL_CALL", []),
    ("[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": x}]',
     ', {"name": "g", "arguments": x}]', [("f", '{"a": 1}')]),
]  # fmt: skip

CASES = (
    [(HermesToolParser, *case) for case in HERMES]
    + [(Llama3JsonToolParser, *case) for case in LLAMA]
    + [(MistralToolParser, *case) for case in MISTRAL]
)

# Outputs that max_tokens ends inside a call: one whose name is out stays a call, its
# arguments as far as they came; one cut before its name is text.
CUT_SHORT = [
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": ', None, [("f", '{"a": ')]),
    (HermesToolParser, 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
     "Checking.", [("get_weather", '{"city": "Pa')]),
    (HermesToolParser, '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n<tool_call>'
     '{"name": "search"', None, [("now", "{}"), ("search", "")]),
    (HermesToolParser, '<tool_call>{"name": "get_wea', '<tool_call>{"name": "get_wea', []),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Pa', None,
     [("get_weather", '{"city": "Pa')]),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", '
     '"parameters": {"x": [1, ', None, [("a", "{}"), ("b", '{"x": [1, ')]),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa', None,
     [("get_weather", '{"city": "Pa')]),
    (MistralToolParser, 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", '
     '"arguments": {"q": "x\\"', "Sure.", [("f", "{}"), ("g", '{"q": "x\\"')]),
    # tool_choice "required": the grammar allows a list of calls alone, so a call cut before
    # its name is a piece of that list, not text.
    (RequiredToolParser, '[{"name": "a", "parameters": {"x": 1}}, {"name": "comp', None,
     [("a", '{"x": 1}')]),
    (RequiredToolParser, '[{"na', "", []),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_whole_output_gives_its_calls_and_content(parser, text, content, calls):
    found = extract_tool_calls(parser(), text)
    assert found == ExtractedToolCalls(content, calls)
    for _, arguments in found.calls:
        assert isinstance(json.loads(arguments), dict)


def _streamed(parser, pieces: list[str], parallel: bool = True) -> ExtractedToolCalls:
    """What a client makes of a stream: the content deltas joined, each call's name and its
    argument fragments joined."""
    stream = ToolCallStream(parser, parallel)
    events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, CallStart):
            assert event.index not in calls and event.index == len(calls)  # each name once
            calls[event.index] = [event.name, ""]
        elif isinstance(event, CallArguments):
            calls[event.index][1] += event.text
    if calls:
        content = content or None
    return ExtractedToolCalls(content, [tuple(c) for c in calls.values()])


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def _breaks_a_started_call(parser, text: str) -> bool:
    p = parser()
    return any(isinstance(e, CallBroken) for e in p.feed(text) + p.finish())


# A call that breaks after its name went out cannot be taken back from a stream.
WELL_FORMED = [case for case in CASES if not _breaks_a_started_call(*case[:2])]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), WELL_FORMED)
def test_a_stream_in_any_pieces_gives_the_same_calls_and_content(parser, text, content, calls):
    rng = random.Random(1234)
    splits = [[text], list(text)] + [_random_pieces(text, rng) for _ in range(200)]
    for pieces in splits:
        assert _streamed(parser(), pieces) == ExtractedToolCalls(content, calls), pieces


def _merged(events: list) -> list:
    merged: list = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, Content) and isinstance(last, Content):
            merged[-1] = Content(last.text + event.text)
        elif isinstance(event, CallArguments) and isinstance(last, CallArguments):
            merged[-1] = CallArguments(last.index, last.text + event.text)
        else:
            merged.append(event)
    return merged


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CUT_SHORT)
def test_a_call_the_output_ends_inside_reads_alike_whole_and_streamed(parser, text, content, calls):
    assert extract_tool_calls(parser(), text) == ExtractedToolCalls(content, calls)
    rng = random.Random(7)
    for pieces in [[text], list(text)] + [_random_pieces(text, rng) for _ in range(50)]:
        assert _streamed(parser(), pieces) == ExtractedToolCalls(content, calls), pieces


@pytest.mark.parametrize(("parser", "text"), [case[:2] for case in CASES + CUT_SHORT])
def test_a_parser_tells_the_same_events_however_the_text_is_split(parser, text):
    whole = parser()
    expected = _merged(whole.feed(text) + whole.finish())
    rng = random.Random(99)
    for pieces in [list(text)] + [_random_pieces(text, rng) for _ in range(100)]:
        split = parser()
        events = [e for piece in pieces for e in split.feed(piece)] + split.finish()
        assert _merged(events) == expected, pieces


def test_a_stream_holds_back_what_could_begin_a_marker():
    stream = ToolCallStream(HermesToolParser())
    assert stream.feed("Checking <tool_") == [Content("Checking")]
    assert stream.feed("ca") == []
    assert stream.feed('ll>{"name": "f"') == [CallStart(0, "f")]
    assert stream.feed(', "arguments": {"a": [1') == [CallArguments(0, '{"a": [1')]
    assert stream.feed("]}}</tool_call>") == [CallArguments(0, "]}")]
    assert stream.finish() == []
    held = ToolCallStream(MistralToolParser())
    assert held.feed("a [TOOL") == [Content("a")]
    assert held.finish() == [Content(" [TOOL")]  # the end decides: it was text


def test_the_cases_cover_calls_broken_before_and_after_their_name():
    assert len(WELL_FORMED) < len(CASES) - 2
    assert sum(1 for case in WELL_FORMED if case[2] is not None and not case[3]) >= 5


def test_a_call_broken_after_its_name_went_out_ends_as_content_in_a_stream():
    text = '<tool_call>{"name": "f", "arguments": {"a": Paris}}</tool_call>'
    assert extract_tool_calls(HermesToolParser(), text) == ExtractedToolCalls(text, [])
    streamed = _streamed(HermesToolParser(), list(text))
    assert streamed.calls[0][0] == "f"
    assert streamed.content == "}</tool_call>"  # what followed the broken arguments


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = HERMES[1][0]
    assert extract_tool_calls(HermesToolParser(), text, parallel=False) == ExtractedToolCalls(
        "Let me look.", [("get_weather", WEATHER)]
    )
    assert _streamed(HermesToolParser(), list(text), parallel=False).calls == [
        ("get_weather", WEATHER)
    ]


def test_forced_outputs_read_as_calls():
    named = extract_tool_calls(NamedToolParser("get_weather"), WEATHER)
    assert named == ExtractedToolCalls(None, [("get_weather", WEATHER)])
    assert _streamed(NamedToolParser("get_weather"), list(WEATHER)) == named
    listed = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    required = extract_tool_calls(RequiredToolParser(), listed)
    assert required == ExtractedToolCalls(None, [("a", '{"x": 1}'), ("b", "{}")])
    assert _streamed(RequiredToolParser(), _random_pieces(listed, random.Random(0))) == required
    # Cut short by max_tokens: the call the stream started stays a call, whole or streamed.
    cut = listed[: listed.index("}")]
    assert extract_tool_calls(RequiredToolParser(), cut).calls == [("a", '{"x": 1')]
    assert _streamed(RequiredToolParser(), list(cut)).calls == [("a", '{"x": 1')]


def test_call_ids_follow_vllms_and_mistrals_practice():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    hermes_id = HermesToolParser.new_call_id()
    assert hermes_id.startswith("chatcmpl-tool-") and len(hermes_id) == len("chatcmpl-tool-") + 32
    ids = {MistralToolParser.new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)
