"""OpenAIServing over a scripted engine: response and SSE shapes, logprobs, usage, limits.

The scripted engine honours AsyncEngine's API and emits a known token sequence, so these
tests pin the OpenAI formats exactly and run in milliseconds (the real engine is covered
end to end in test_serve_openai.py).
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from pydantic import ValidationError

from engine.api.errors import APIError
from engine.api.inputs import to_sampling_params
from engine.api.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
)
from engine.api.serving import OpenAIServing, RequestContext
from engine.async_engine import EngineDeadError
from engine.outputs import RequestFailedError
from engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutput,
    StructuredOutputError,
)
from tests.support.fakes import (
    ANSWER,
    MAX_MODEL_LEN,
    ScriptedEngine,
)
from tests.support.fakes import scripted_chat as _chat
from tests.support.fakes import scripted_completion as _completion
from tests.support.openai_streams import sse_events as _events


def _serving(tokenizer, **kw) -> tuple[OpenAIServing, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer, **kw)
    return OpenAIServing(engine), engine


def _stream(create, request, ctx=None) -> list[dict | str]:
    async def run():
        return await _events(await create(request, ctx))

    return asyncio.run(run())


def test_chat_stream_follows_openai_chunk_format(tokenizer):
    serving, _ = _serving(tokenizer)

    async def run():
        full = await serving.create_chat_completion(_chat(max_tokens=5))
        stream = await serving.create_chat_completion(
            _chat(max_tokens=5, stream=True, stream_options={"include_usage": True})
        )
        return full, await _events(stream), stream.usage

    full, events, usage = asyncio.run(run())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(
        c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks
    )
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["delta"] == {}
    assert finals[0]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert (
        text
        == full.choices[0].message.content
        == tokenizer.decode(tokenizer.encode(ANSWER, add_special_tokens=False)[:5])
    )
    # include_usage: every chunk carries "usage": null, the last one the counts and no choices.
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == full.usage.model_dump() == usage.model_dump()
    assert full.usage.completion_tokens == 5
    assert full.usage.total_tokens == full.usage.prompt_tokens + 5


def test_stream_without_include_usage_has_no_usage_field(tokenizer):
    serving, _ = _serving(tokenizer)
    events = _stream(serving.create_completion, _completion(max_tokens=3, stream=True))
    assert events[-1] == "[DONE]"
    assert all("usage" not in c for c in events[:-1])
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) != ""


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(tokenizer):
    serving, _ = _serving(tokenizer)
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = _stream(
        serving.create_completion, _completion(max_tokens=4, stream=True, stream_options=options)
    )
    chunks = events[:-1]
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert prompt_tokens > 0 and chunks[-1]["usage"]["completion_tokens"] == 4
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 4
    for c in chunks:
        usage = c["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
    # Without include_usage it changes nothing.
    events = _stream(
        serving.create_completion,
        _completion(max_tokens=2, stream=True, stream_options={"continuous_usage_stats": True}),
    )
    assert all("usage" not in c for c in events[:-1])


def test_completion_logprobs_shape_and_offsets(tokenizer):
    serving, _ = _serving(tokenizer)

    async def run():
        full = await serving.create_completion(_completion(max_tokens=4, logprobs=2))
        stream = await serving.create_completion(_completion(max_tokens=4, logprobs=2, stream=True))
        return full, await _events(stream)

    full, events = asyncio.run(run())
    lp = full.choices[0].logprobs
    assert "".join(lp.tokens) == full.choices[0].text
    assert lp.token_logprobs == [-0.5] * 4
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    streamed = [c["choices"][0]["logprobs"] for c in events[:-1] if c["choices"][0]["logprobs"]]
    assert sum((s["tokens"] for s in streamed), []) == lp.tokens
    assert sum((s["text_offset"] for s in streamed), []) == lp.text_offset


def test_chat_logprobs_shape(tokenizer):
    serving, engine = _serving(tokenizer)
    full = asyncio.run(
        serving.create_chat_completion(_chat(max_tokens=3, logprobs=True, top_logprobs=3))
    )
    assert engine.calls[0]["params"].logprobs == 3
    content = full.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob == -0.5 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
    assert "".join(e.token for e in content) == full.choices[0].message.content

    plain = asyncio.run(serving.create_chat_completion(_chat(max_tokens=3)))
    assert plain.choices[0].logprobs is None and engine.calls[1]["params"].logprobs is None


def test_n_and_several_prompts_number_the_choices(tokenizer):
    serving, _ = _serving(tokenizer)
    full = asyncio.run(
        serving.create_completion(_completion(prompt=["a", "b c"], n=2, max_tokens=2))
    )
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert full.choices[0].text != full.choices[1].text  # sample 1 is shifted by one token
    assert full.usage.completion_tokens == 8

    events = _stream(
        serving.create_completion, _completion(prompt=["a", "b"], n=2, max_tokens=2, stream=True)
    )
    finished = {c["choices"][0]["index"] for c in events[:-1] if c["choices"][0]["finish_reason"]}
    assert finished == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"temperature": -1}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": -5}, 400, "max_tokens"),
        ({"max_tokens": 10**9}, 400, "max_tokens"),
        ({"prompt": "word " * 200}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"model": "gpt-17"}, 404, "model"),
        ({"seed": 2**70}, 400, "seed"),
        ({"logit_bias": {"seven": 1}}, 400, "logit_bias"),
        ({"logit_bias": {"7": 101}}, 400, "logit_bias"),
        ({"logit_bias": {"-7": 1}}, 400, "logit_bias"),
    ],
)
def test_completion_input_errors(tokenizer, fields, status, param):
    serving, engine = _serving(tokenizer)
    with pytest.raises(APIError) as info:
        asyncio.run(serving.create_completion(_completion(**fields)))
    assert info.value.status_code == status and info.value.param == param
    assert param in info.value.message or "model" in info.value.message
    assert engine.calls == []


PROMPT = "Count: one, two"
"""ASCII: its tokens' texts join to exactly this text."""


def _token_texts(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


def _by_choice(events: list) -> dict[int, list[dict]]:
    """A completion stream's chunk choices, by choice index, in order."""
    out: dict[int, list[dict]] = {}
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            out.setdefault(choice["index"], []).append(choice)
    return out


def test_echo_starts_every_choice_with_its_prompt(tokenizer):
    serving, engine = _serving(tokenizer)
    ids = tokenizer.encode("Count: one", add_special_tokens=False)

    async def run():
        texts = _completion(prompt=["Count:", "a b"], n=2, max_tokens=2)
        plain = await serving.create_completion(texts)
        echoed = await serving.create_completion(texts.model_copy(update={"echo": True}))
        by_ids = await serving.create_completion(_completion(prompt=ids, max_tokens=2, echo=True))
        return plain, echoed, by_ids

    plain, echoed, by_ids = asyncio.run(run())
    prompts = ["Count:", "Count:", "a b", "a b"]
    assert [c.text for c in echoed.choices] == [
        p + c.text for p, c in zip(prompts, plain.choices, strict=True)
    ]
    assert by_ids.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text
    assert echoed.usage == plain.usage
    # Prompt logprobs would cost the prefix cache's hits: echo alone does not ask for them.
    assert [call["params"].prompt_logprobs for call in engine.calls] == [None] * 5


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(tokenizer):
    serving, engine = _serving(tokenizer)
    request = _completion(prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0)
    full = asyncio.run(serving.create_completion(request))
    prompt_ids = engine.calls[0]["prompt"]
    assert engine.calls[0]["params"].prompt_logprobs == 1
    choice, generated = full.choices[0], engine.answer_ids[:1]
    lp = choice.logprobs
    assert choice.text == PROMPT + tokenizer.decode(generated)
    assert lp.tokens == _token_texts(tokenizer, prompt_ids + generated)
    n = len(prompt_ids) + 1
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = engine.prompt_logprobs(prompt_ids, 1)
    assert lp.token_logprobs[1:] == [e.logprob for e in expected[1:]] + [-0.5]
    # The top-1 is the prompt token itself exactly where the scripted engine ranks it first.
    assert [lp.tokens[j] in top for j, top in enumerate(lp.top_logprobs[1:-1], 1)] == [
        j % 2 == 1 for j in range(1, len(prompt_ids))
    ]
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert all(choice.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens))
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n)]


def test_echo_logprobs_offsets_point_at_the_completion_after_any_prompt(tokenizer):
    """A character split over several tokens has token texts longer than the prompt; the
    first generated token's offset is still where the completion starts in the text."""
    serving, engine = _serving(tokenizer)
    prompt = "日本"
    full = asyncio.run(
        serving.create_completion(_completion(prompt=prompt, max_tokens=2, echo=True, logprobs=0))
    )
    n_prompt = len(engine.calls[0]["prompt"])
    choice = full.choices[0]
    assert len("".join(choice.logprobs.tokens[:n_prompt])) != len(prompt)
    offsets = choice.logprobs.text_offset
    assert choice.text[offsets[n_prompt] :] == tokenizer.decode(engine.answer_ids[:2])
    assert choice.text[offsets[n_prompt + 1] :] == tokenizer.decode(engine.answer_ids[1:2])


def test_echo_with_max_tokens_0_returns_only_the_scored_prompt(tokenizer):
    serving, engine = _serving(tokenizer)
    fields = dict(prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    full = asyncio.run(serving.create_completion(_completion(**fields)))
    events = _stream(
        serving.create_completion,
        _completion(stream=True, stream_options={"include_usage": True}, **fields),
    )
    assert [call["params"].max_tokens for call in engine.calls] == [1, 1]
    prompt_ids = engine.calls[0]["prompt"]
    choice = full.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs.tokens == _token_texts(tokenizer, prompt_ids)
    assert len(choice.logprobs.token_logprobs) == len(prompt_ids)
    usage = full.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 0)
    assert usage.total_tokens == len(prompt_ids)

    (chunks,) = _by_choice(events).values()
    assert "".join(c["text"] for c in chunks) == PROMPT
    assert chunks[-1]["finish_reason"] == "length"
    assert [c["logprobs"]["tokens"] for c in chunks if c["logprobs"]] == [choice.logprobs.tokens]
    assert events[-2]["usage"] == usage.model_dump()


def test_a_stream_echoes_each_prompt_first_with_its_logprobs(tokenizer):
    serving, _ = _serving(tokenizer)
    prompts = ["Count:", "a b"]
    fields = dict(prompt=prompts, n=2, max_tokens=3, echo=True, logprobs=1)
    full = asyncio.run(serving.create_completion(_completion(**fields)))
    by_choice = _by_choice(_stream(serving.create_completion, _completion(stream=True, **fields)))
    assert sorted(by_choice) == [c.index for c in full.choices] == [0, 1, 2, 3]
    for expected in full.choices:
        chunks = by_choice[expected.index]
        prompt = prompts[expected.index // 2]
        first = chunks[0]
        assert first["text"] == prompt and first["finish_reason"] is None
        n_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
        assert len(first["logprobs"]["tokens"]) == n_prompt
        assert first["logprobs"]["token_logprobs"][0] is None
        assert "".join(c["text"] for c in chunks) == expected.text
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            joined = sum((c["logprobs"][key] for c in chunks), [])
            assert joined == getattr(expected.logprobs, key), key


def test_a_stream_echoes_the_prompt_before_the_first_token_without_logprobs(tokenizer):
    serving, engine = _serving(tokenizer, step_delay_s=0.05)

    async def run():
        stream = await serving.create_completion(_completion(max_tokens=3, echo=True, stream=True))
        first = await anext(stream.events)
        steps = engine.num_token_steps
        await stream.events.aclose()
        return first, steps

    first, steps = asyncio.run(run())
    assert steps == 0
    assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] == "Count:"


def test_prompt_logprobs_in_vllm_shape(tokenizer):
    serving, engine = _serving(tokenizer)
    full = asyncio.run(
        serving.create_completion(_completion(prompt=PROMPT, max_tokens=2, prompt_logprobs=2))
    )
    params = engine.calls[0]["params"]
    assert (params.prompt_logprobs, params.logprobs) == (2, None)
    prompt_ids = engine.calls[0]["prompt"]
    body = full.model_dump(mode="json")["choices"][0]
    assert body["text"] == tokenizer.decode(engine.answer_ids[:2]) and body["logprobs"] is None
    positions = body["prompt_logprobs"]
    assert len(positions) == len(prompt_ids) and positions[0] is None
    expected = engine.prompt_logprobs(prompt_ids, 2)
    for j, (token_id, position) in enumerate(zip(prompt_ids, positions), start=0):
        if j == 0:
            continue
        own = position[str(token_id)]
        assert own == {
            "logprob": expected[j].logprob,
            "rank": expected[j].rank,
            "decoded_token": tokenizer.decode([token_id]),
        }
        # The top 2 at ranks 1 and 2, and the prompt token at its own rank (4) if not one.
        ranks = sorted(c["rank"] for c in position.values())
        assert ranks == ([1, 2] if j % 2 else [1, 2, 4])
        assert all(c["decoded_token"] == tokenizer.decode([int(i)]) for i, c in position.items())

    plain = asyncio.run(serving.create_completion(_completion(max_tokens=2)))
    assert "prompt_logprobs" not in plain.model_dump(mode="json")["choices"][0]


def test_a_chat_response_carries_prompt_logprobs_when_asked(tokenizer):
    serving, engine = _serving(tokenizer)
    full = asyncio.run(serving.create_chat_completion(_chat(max_tokens=2, prompt_logprobs=1)))
    assert engine.calls[0]["params"].prompt_logprobs == 1
    prompt_ids = engine.calls[0]["prompt"]
    positions = full.model_dump(mode="json")["prompt_logprobs"]
    assert len(positions) == len(prompt_ids) and positions[0] is None
    expected = engine.prompt_logprobs(prompt_ids, 1)
    for j in range(1, len(prompt_ids)):
        assert positions[j][str(prompt_ids[j])]["logprob"] == expected[j].logprob
    plain = asyncio.run(serving.create_chat_completion(_chat(max_tokens=2)))
    assert "prompt_logprobs" not in plain.model_dump(mode="json")
    assert engine.calls[1]["params"].prompt_logprobs is None
    with pytest.raises(APIError, match="stream") as info:
        asyncio.run(
            serving.create_chat_completion(_chat(max_tokens=2, prompt_logprobs=1, stream=True))
        )
    assert info.value.param == "prompt_logprobs"


def test_echo_logprobs_and_prompt_logprobs_each_show_their_own_top_n(tokenizer):
    serving, engine = _serving(tokenizer)
    request = _completion(prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, prompt_logprobs=3)
    choice = asyncio.run(serving.create_completion(request)).choices[0]
    assert engine.calls[0]["params"].prompt_logprobs == 3
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])
    for position in choice.prompt_logprobs[1:]:
        assert sorted(c.rank for c in position.values())[:3] == [1, 2, 3]


def test_a_stream_sends_prompt_logprobs_with_a_choices_first_text(tokenizer):
    serving, _ = _serving(tokenizer)
    fields = dict(prompt=PROMPT, n=2, max_tokens=3, prompt_logprobs=1)
    full = asyncio.run(serving.create_completion(_completion(**fields)))
    by_choice = _by_choice(_stream(serving.create_completion, _completion(stream=True, **fields)))
    expected = full.model_dump(mode="json")["choices"][0]["prompt_logprobs"]
    for chunks in by_choice.values():
        assert chunks[0]["text"] and chunks[0]["prompt_logprobs"] == expected
        assert all("prompt_logprobs" not in c for c in chunks[1:])


def test_return_token_ids_shows_each_completions_prompt_and_generated_ids(tokenizer):
    serving, engine = _serving(tokenizer)
    prompts = ["Count:", "Then count on:"]
    fields = dict(prompt=prompts, n=2, max_tokens=4, return_token_ids=True)
    full = asyncio.run(serving.create_completion(_completion(**fields)))
    events = _stream(serving.create_completion, _completion(stream=True, **fields))
    asked = [call["prompt"] for call in engine.calls[:2]]
    assert asked == [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    streamed = _by_choice(events)
    for choice in full.choices:
        prompt_ids = asked[choice.index // 2]
        assert choice.prompt_token_ids == prompt_ids
        assert len(choice.token_ids) == 4 and tokenizer.decode(choice.token_ids) == choice.text
        chunks = streamed[choice.index]
        assert chunks[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        assert [t for c in chunks for t in c["token_ids"]] == choice.token_ids
    plain = asyncio.run(serving.create_completion(_completion(max_tokens=2)))
    plain_events = _stream(serving.create_completion, _completion(max_tokens=2, stream=True))
    assert "token_ids" not in plain.model_dump_json()
    assert not any("token_ids" in json.dumps(e) for e in plain_events)


def test_return_token_ids_with_echo_streams_the_prompt_ids_with_the_echo(tokenizer):
    serving, _ = _serving(tokenizer)
    fields = dict(echo=True, max_tokens=3, return_token_ids=True)
    full = asyncio.run(serving.create_completion(_completion(**fields)))
    (choice,) = full.choices
    assert choice.prompt_token_ids == tokenizer.encode("Count:", add_special_tokens=False)
    assert choice.text == "Count:" + tokenizer.decode(choice.token_ids)
    chunks = _by_choice(_stream(serving.create_completion, _completion(stream=True, **fields)))[0]
    assert chunks[0]["text"] == "Count:" and chunks[0]["token_ids"] == []
    assert chunks[0]["prompt_token_ids"] == choice.prompt_token_ids
    assert [t for c in chunks for t in c["token_ids"]] == choice.token_ids
    only_prompt = asyncio.run(
        serving.create_completion(_completion(echo=True, max_tokens=0, return_token_ids=True))
    )
    assert only_prompt.choices[0].token_ids == []


def test_return_token_ids_on_a_chat_whole_and_streamed(tokenizer):
    serving, engine = _serving(tokenizer)
    fields = dict(max_tokens=5, n=2, return_token_ids=True)
    full = asyncio.run(serving.create_chat_completion(_chat(**fields)))
    prompt_ids = engine.calls[0]["prompt"]
    assert full.prompt_token_ids == prompt_ids
    assert tokenizer.decode(prompt_ids).endswith("assistant\n")
    events = _stream(serving.create_chat_completion, _chat(stream=True, **fields))
    chunks = events[:-1]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    for choice in full.choices:
        assert len(choice.token_ids) == 5
        assert tokenizer.decode(choice.token_ids) == choice.message.content
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice.index]
        assert all(isinstance(c["token_ids"], list) for c in mine)
        assert [t for c in mine for t in c["token_ids"]] == choice.token_ids
    plain = asyncio.run(serving.create_chat_completion(_chat(max_tokens=2)))
    assert "token_ids" not in plain.model_dump_json()


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(tokenizer):
    serving, _ = _serving(tokenizer)
    fields = dict(max_tokens=4, logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True)
    full = asyncio.run(serving.create_completion(_completion(**fields)))
    (choice,) = full.choices
    named = [f"token_id:{t}" for t in choice.token_ids]
    assert choice.logprobs.tokens == named
    assert all(next(iter(top)) == name for top, name in zip(choice.logprobs.top_logprobs, named))
    assert choice.text == tokenizer.decode(choice.token_ids)
    events = _stream(serving.create_completion, _completion(stream=True, **fields))
    assert [t for c in _by_choice(events)[0] for t in c["logprobs"]["tokens"]] == named
    chat = asyncio.run(
        serving.create_chat_completion(
            _chat(max_tokens=3, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)
        )
    )
    content = chat.choices[0].logprobs.content
    assert all(e.token.startswith("token_id:") for e in content)
    assert [e.bytes for e in content] == [list(e.token.encode()) for e in content]
    assert [e.top_logprobs[0].token for e in content] == [e.token for e in content]
    plain = asyncio.run(serving.create_completion(_completion(max_tokens=2, logprobs=1)))
    assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)


def test_prompt_logprobs_are_asked_of_the_engine_only_when_shown():
    cases = [
        ({}, None),
        ({"echo": True}, None),
        ({"logprobs": 3}, None),
        ({"echo": True, "logprobs": 3}, 3),
        ({"echo": True, "logprobs": 0}, 0),
        ({"prompt_logprobs": 2}, 2),
        ({"echo": True, "logprobs": 1, "prompt_logprobs": 4}, 4),
        ({"echo": True, "logprobs": 5, "prompt_logprobs": 0}, 5),
    ]
    for fields, expected in cases:
        request = _completion(**fields)
        params = to_sampling_params(request, 3, MAX_MODEL_LEN, 4, "max_tokens", request.logprobs)
        assert params.prompt_logprobs == expected, fields
    chat = to_sampling_params(
        _chat(logprobs=True, top_logprobs=3), 3, MAX_MODEL_LEN, 4, "max_tokens", 3
    )
    assert chat.prompt_logprobs is None


def test_echo_and_max_tokens_0_refusals_name_the_field(tokenizer):
    serving, engine = _serving(tokenizer)
    with pytest.raises(APIError) as info:
        asyncio.run(serving.create_completion(_completion(max_tokens=0)))
    assert (info.value.status_code, info.value.param) == (400, "max_tokens")
    assert "echo" in info.value.message
    with pytest.raises(APIError) as info:
        asyncio.run(serving.create_chat_completion(_chat(max_tokens=0)))
    assert info.value.param == "max_tokens" and "echo" not in info.value.message

    no_tokenizer = ScriptedEngine(tokenizer)
    no_tokenizer.tokenizer = None  # a model served without one (dummy weights)
    with pytest.raises(APIError) as info:
        asyncio.run(
            OpenAIServing(no_tokenizer).create_completion(_completion(prompt=[5, 6], echo=True))
        )
    assert (info.value.status_code, info.value.param) == (400, "echo")
    assert engine.calls == no_tokenizer.calls == []


def test_chat_input_errors(tokenizer):
    serving, _ = _serving(tokenizer)
    cases = [
        (_chat(max_completion_tokens=0), "max_completion_tokens"),
        (_chat(max_tokens=MAX_MODEL_LEN), "max_tokens"),
        (_chat(top_logprobs=2), "top_logprobs"),
        (_chat(messages=[{"role": "user", "content": "long " * 100}]), "messages"),
        (_chat(response_format={"type": "json_schema"}), "response_format"),
    ]
    for request, param in cases:
        with pytest.raises(APIError) as info:
            asyncio.run(serving.create_chat_completion(request))
        assert info.value.status_code == 400 and info.value.param == param, info.value.message


def test_response_format_reaches_the_engine_as_a_structured_output(tokenizer):
    serving, engine = _serving(tokenizer)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    formats = [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}},
    ]
    asyncio.run(serving.create_chat_completion(_chat(max_tokens=2)))
    for fmt in formats:
        asyncio.run(serving.create_chat_completion(_chat(max_tokens=2, response_format=fmt)))
    asyncio.run(serving.create_completion(_completion(response_format=formats[2])))
    specs = [call["params"].structured_output for call in engine.calls]
    assert specs == [None, None, StructuredOutput(), StructuredOutput(json.dumps(schema))] + [
        StructuredOutput(json.dumps(schema))
    ]
    with pytest.raises(ValidationError, match="response_format"):
        _chat(response_format={"type": "yaml"})


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tokenizer):
    serving, engine = _serving(tokenizer)
    long_prompt = "word " * (MAX_MODEL_LEN + 10)
    ids = tokenizer.encode(long_prompt, add_special_tokens=False)
    asyncio.run(
        serving.create_completion(_completion(prompt=long_prompt, truncate_prompt_tokens=-1))
    )
    asyncio.run(serving.create_chat_completion(_chat(max_tokens=2, truncate_prompt_tokens=3)))
    response = asyncio.run(
        serving.create_completion(
            _completion(prompt=ids, truncate_prompt_tokens=5, echo=True, max_tokens=0)
        )
    )
    first, chat, echoed = (call["prompt"] for call in engine.calls)
    assert first == ids[-(MAX_MODEL_LEN - 1) :]
    assert len(chat) == 3 and tokenizer.decode(chat).endswith("assistant\n")
    assert echoed == ids[-5:] and response.choices[0].text == tokenizer.decode(ids[-5:])
    with pytest.raises(APIError, match="max_model_len"):
        asyncio.run(serving.create_completion(_completion(prompt=long_prompt)))
    for bad in (0, -2, MAX_MODEL_LEN + 1):
        with pytest.raises((APIError, ValidationError), match="truncate_prompt_tokens"):
            asyncio.run(serving.create_completion(_completion(truncate_prompt_tokens=bad)))


def test_allowed_token_ids_reach_the_engine(tokenizer):
    serving, engine = _serving(tokenizer)
    asyncio.run(serving.create_completion(_completion(allowed_token_ids=[5, 6])))
    assert engine.calls[0]["params"].allowed_token_ids == [5, 6]
    for bad in ([], [-1], ["5"]):
        with pytest.raises((APIError, ValidationError), match="allowed_token_ids"):
            asyncio.run(serving.create_completion(_completion(allowed_token_ids=bad)))


def test_a_chat_can_continue_the_final_message(tokenizer):
    serving, engine = _serving(tokenizer)
    messages = [
        {"role": "user", "content": "Introduce yourself."},
        {"role": "assistant", "content": "Hello, my name"},
    ]
    fields = dict(messages=messages, max_tokens=2, add_generation_prompt=False)
    asyncio.run(serving.create_chat_completion(_chat(continue_final_message=True, **fields)))
    asyncio.run(serving.create_chat_completion(_chat(**fields)))
    continued, closed = (tokenizer.decode(call["prompt"]) for call in engine.calls)
    assert continued.endswith("assistant\nHello, my name")
    assert closed.rstrip().endswith("<|im_end|>")
    with pytest.raises(APIError, match="add_generation_prompt") as info:
        asyncio.run(
            serving.create_chat_completion(_chat(messages=messages, continue_final_message=True))
        )
    assert info.value.param == "continue_final_message"


def test_vllms_structured_outputs_reach_the_engine(tokenizer):
    serving, engine = _serving(tokenizer)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    cases = [
        ({"json": schema}, StructuredOutput(json.dumps(schema))),
        ({"json": '{"type": "string"}'}, StructuredOutput('{"type": "string"}')),
        ({"regex": "[0-9]+"}, StructuredOutput(regex="[0-9]+")),
        ({"choice": ["yes", "no"]}, StructuredOutput(choice=("yes", "no"))),
        ({"grammar": 'root ::= "a"'}, StructuredOutput(grammar='root ::= "a"')),
        ({"json_object": True}, StructuredOutput()),
    ]
    for fields, _ in cases:
        asyncio.run(serving.create_completion(_completion(structured_outputs=fields)))
        asyncio.run(serving.create_chat_completion(_chat(max_tokens=2, structured_outputs=fields)))
    specs = [call["params"].structured_output for call in engine.calls]
    assert specs == [want for _, want in cases for _ in range(2)]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one of .* got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"json_object": False}, "got none"),
    ],
)
def test_structured_outputs_takes_exactly_one_kind(tokenizer, fields, message):
    serving, engine = _serving(tokenizer)
    with pytest.raises(APIError, match=message) as info:
        asyncio.run(serving.create_completion(_completion(structured_outputs=fields)))
    assert info.value.status_code == 400 and info.value.param == "structured_outputs"
    assert engine.calls == []


def test_structured_outputs_beside_a_json_response_format_is_refused(tokenizer):
    serving, _ = _serving(tokenizer)
    request = _chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    with pytest.raises(APIError, match="not both") as info:
        asyncio.run(serving.create_chat_completion(request))
    assert info.value.param == "structured_outputs"
    for bad in ({"regexp": "a"}, {"choice": []}, {"choice": "yes"}):
        with pytest.raises(ValidationError, match="structured_outputs"):
            _completion(structured_outputs=bad)


def test_an_engine_refusal_of_a_regex_names_structured_outputs(tokenizer):
    serving, engine = _serving(tokenizer)
    engine.fail = StructuredOutputError("structured_output: a regular expression ...")
    with pytest.raises(APIError, match="^structured_outputs: a regular expression") as info:
        asyncio.run(serving.create_completion(_completion(structured_outputs={"regex": "("})))
    assert info.value.status_code == 400 and info.value.param == "structured_outputs"


def test_an_engine_refusal_of_a_schema_names_response_format(tokenizer):
    serving, engine = _serving(tokenizer)
    engine.fail = StructuredOutputError("structured_output: a JSON schema ...")
    with pytest.raises(APIError, match="^response_format: a JSON schema") as info:
        asyncio.run(serving.create_chat_completion(_chat(response_format={"type": "json_object"})))
    assert info.value.status_code == 400 and info.value.param == "response_format"


def test_logit_bias_reaches_the_engine_by_token_id(tokenizer):
    serving, engine = _serving(tokenizer)
    asyncio.run(serving.create_completion(_completion(logit_bias={"7": 5, "12": -100.0})))
    asyncio.run(serving.create_chat_completion(_chat(logit_bias={"3": 1.5}, max_tokens=2)))
    assert [call["params"].logit_bias for call in engine.calls] == [{7: 5.0, 12: -100.0}, {3: 1.5}]


def test_max_tokens_defaults_fit_the_context(tokenizer):
    serving, engine = _serving(tokenizer)
    prompt = "word " * 55  # 55 tokens: OpenAI's default of 16 would overflow 64
    asyncio.run(serving.create_completion(_completion(prompt=prompt)))
    n_prompt = len(engine.calls[0]["prompt"])
    assert engine.calls[0]["params"].max_tokens == MAX_MODEL_LEN - n_prompt < 16
    asyncio.run(serving.create_chat_completion(_chat(max_tokens=None)))
    n_prompt = len(engine.calls[1]["prompt"])
    assert engine.calls[1]["params"].max_tokens == MAX_MODEL_LEN - n_prompt


def test_any_served_name_is_taken_and_responses_carry_the_first(tokenizer):
    engine = ScriptedEngine(tokenizer)
    engine.served_model_names = ["main", "alias"]
    serving = OpenAIServing(engine)
    response = asyncio.run(serving.create_completion(_completion(model="alias", max_tokens=1)))
    assert response.model == "main"
    assert [card.id for card in serving.models().data] == ["main", "alias"]
    with pytest.raises(APIError) as refused:
        asyncio.run(serving.create_completion(_completion(model="other", max_tokens=1)))
    assert refused.value.status_code == 404
    assert "`main`, `alias`" in refused.value.message


def test_a_client_s_request_id_names_its_responses_and_engine_ids_stay_unique(tokenizer):
    serving, engine = _serving(tokenizer)
    ctx = RequestContext(request_id="trace-7")
    completion = asyncio.run(serving.create_completion(_completion(max_tokens=1, n=2), ctx))
    chat = asyncio.run(serving.create_chat_completion(_chat(max_tokens=1), ctx))
    streamed = _stream(serving.create_completion, _completion(max_tokens=2, stream=True), ctx)
    assert completion.id == "cmpl-trace-7"
    assert chat.id == "chatcmpl-trace-7"
    assert {event["id"] for event in streamed if isinstance(event, dict)} == {"cmpl-trace-7"}
    # The same id again (a retry while the first still runs) is no clash in the engine.
    engine_ids = [call["request_id"] for call in engine.calls]
    assert len(set(engine_ids)) == len(engine_ids) == 3
    # Without one, each response gets an id of its own.
    ids = {asyncio.run(serving.create_completion(_completion(max_tokens=1))).id for _ in "ab"}
    assert len(ids) == 2 and all(i.startswith("cmpl-") for i in ids)


def test_priority_never_beats_the_tenant_and_salt_passes_through(tokenizer):
    serving, engine = _serving(tokenizer)
    ctx = RequestContext(priority=5, cache_salt="tenant-a")
    asyncio.run(serving.create_chat_completion(_chat(max_tokens=1, priority=1), ctx))
    asyncio.run(serving.create_chat_completion(_chat(max_tokens=1, priority=9), ctx))
    asyncio.run(serving.create_chat_completion(_chat(max_tokens=1), ctx))
    assert [c["priority"] for c in engine.calls] == [5, 9, 5]
    assert {c["cache_salt"] for c in engine.calls} == {"tenant-a"}


def test_a_request_s_cache_salt_splits_its_tenant_s_cache_and_never_reaches_another_s(
    tokenizer,
):
    serving, engine = _serving(tokenizer)
    for tenant, salt in [("a", "x"), ("a", "x"), ("a", "y"), ("b", "x"), (None, "x")]:
        request = _completion(prompt="Hi", max_tokens=1, cache_salt=salt)
        asyncio.run(serving.create_completion(request, RequestContext(cache_salt=tenant)))
    salts = [c["cache_salt"] for c in engine.calls]
    assert salts[0] == salts[1]
    assert len(set(salts[1:])) == 4
    assert not {"a", "b", "x", "y", None} & set(salts)
    with pytest.raises(ValidationError, match="cache_salt"):
        _completion(prompt="Hi", cache_salt="")


def test_deadline_aborts_a_slow_request(tokenizer):
    import time

    serving, engine = _serving(tokenizer, step_delay_s=0.05)
    ctx = RequestContext(deadline=time.time() + 0.3)
    with pytest.raises(APIError) as info:
        asyncio.run(serving.create_completion(_completion(max_tokens=40), ctx))
    assert info.value.status_code == 408
    assert len(engine.closed) == 1

    events = _stream(
        serving.create_completion,
        _completion(max_tokens=40, stream=True),
        RequestContext(deadline=time.time() + 0.3),
    )
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    assert len(engine.closed) == 2


def test_dead_engine_is_a_503(tokenizer):
    serving, _ = _serving(tokenizer, fail=EngineDeadError("device lost"))
    with pytest.raises(APIError) as info:
        asyncio.run(serving.create_chat_completion(_chat(max_tokens=2)))
    assert info.value.status_code == 503


def test_a_request_the_engine_fails_alone_is_a_500_before_or_within_its_stream(tokenizer):
    error = RequestFailedError("request x failed: RuntimeError: mask broke")
    serving, _ = _serving(tokenizer, fail=error, fail_at_step=2)
    with pytest.raises(APIError) as info:
        asyncio.run(serving.create_chat_completion(_chat(max_tokens=4)))
    assert info.value.status_code == 500 and "mask broke" in info.value.message
    events = _stream(serving.create_completion, _completion(max_tokens=4, stream=True))
    assert events[-1] == "[DONE]" and "mask broke" in events[-2]["error"]["message"]
    assert events[-2]["error"]["type"] == "InternalServerError"
    assert events[0]["choices"][0]["text"] == " one"  # the token before it came through


def test_a_stream_starts_when_the_engine_takes_the_request(tokenizer):
    serving, engine = _serving(tokenizer, step_delay_s=0.05)

    async def run():
        stream = await serving.create_completion(_completion(max_tokens=3, stream=True))
        steps_at_start = engine.num_token_steps
        return steps_at_start, await _events(stream)

    steps_at_start, events = asyncio.run(run())
    assert steps_at_start == 0  # the response can start before the first token
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == " one two three"


def test_only_a_stream_asks_the_engine_for_every_output(tokenizer):
    serving, engine = _serving(tokenizer)
    asyncio.run(serving.create_completion(_completion(max_tokens=3)))
    _stream(serving.create_chat_completion, _chat(max_tokens=3, stream=True))
    asyncio.run(serving.create_chat_completion(_chat(max_tokens=3)))
    kinds = [call["params"].output_kind for call in engine.calls]
    assert kinds == [
        RequestOutputKind.FINAL_ONLY,
        RequestOutputKind.CUMULATIVE,
        RequestOutputKind.FINAL_ONLY,
    ]


def test_a_prompt_the_engine_refuses_fails_a_stream_of_several_before_it_starts(tokenizer):
    serving, engine = _serving(tokenizer, step_delay_s=0.05, refuse="Bad")
    request = _completion(prompt=["Count:", "Bad input"], max_tokens=3, stream=True)
    with pytest.raises(APIError) as info:
        asyncio.run(serving.create_completion(request))
    assert info.value.status_code == 400 and "Bad" in info.value.message
    assert engine.num_requests == 0 and engine.num_token_steps == 0  # the other one too


def _tokenize_request(**fields) -> TokenizeRequest:
    return TokenizeRequest.model_validate_json(json.dumps(fields))


def test_tokenize_gives_the_ids_a_completion_or_a_chat_computes(tokenizer):
    serving, engine = _serving(tokenizer)
    prompt = "Count: one, two"
    asyncio.run(serving.create_completion(_completion(prompt=prompt, max_tokens=1)))
    asyncio.run(serving.create_chat_completion(_chat(max_tokens=1)))
    by_prompt = asyncio.run(serving.tokenize(_tokenize_request(prompt=prompt)))
    assert by_prompt.tokens == engine.calls[0]["prompt"] and by_prompt.count == len(
        by_prompt.tokens
    )
    assert by_prompt.max_model_len == MAX_MODEL_LEN and by_prompt.token_strs is None
    messages = [{"role": "user", "content": "Count"}]
    by_messages = asyncio.run(serving.tokenize(_tokenize_request(messages=messages)))
    assert by_messages.tokens == engine.calls[1]["prompt"]
    with_strs = asyncio.run(
        serving.tokenize(_tokenize_request(prompt=prompt, return_token_strs=True))
    )
    assert with_strs.token_strs == tokenizer.convert_ids_to_tokens(by_prompt.tokens)
    back = serving.detokenize(DetokenizeRequest(tokens=by_prompt.tokens))
    assert back.prompt == prompt


@pytest.mark.parametrize(
    ("call", "fields", "status", "param"),
    [
        ("tokenize", {}, 400, "prompt"),
        (
            "tokenize",
            {"prompt": "a", "messages": [{"role": "user", "content": "a"}]},
            400,
            "prompt",
        ),
        ("tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ],
)
def test_tokenizer_calls_refuse_bad_input_naming_the_field(tokenizer, call, fields, status, param):
    serving, _ = _serving(tokenizer)

    async def run():
        if call == "tokenize":
            return await serving.tokenize(_tokenize_request(**fields))
        return serving.detokenize(DetokenizeRequest.model_validate_json(json.dumps(fields)))

    with pytest.raises(APIError) as info:
        asyncio.run(run())
    assert (info.value.status_code, info.value.param) == (status, param)


def test_models_lists_the_served_model(tokenizer):
    serving, _ = _serving(tokenizer)
    models = serving.models().model_dump()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["scripted"]
    assert models["data"][0]["quantization"] == "none"


def test_models_say_how_the_weights_run(tokenizer):
    engine = ScriptedEngine(tokenizer)
    engine.quantization = "fp8"
    serving = OpenAIServing(engine)
    assert serving.models().model_dump()["data"][0]["quantization"] == "fp8"


def test_long_prompts_tokenize_while_the_event_loop_streams_other_requests(tokenizer, monkeypatch):
    """With another request in flight, tokenizing a long prompt (completion or chat) leaves
    the event loop free: the other request's next output arrives meanwhile. Each blocking
    tokenizer below returns only after it has."""
    loop_ran = threading.Event()

    def after_the_loop_ran(ids):
        assert loop_ran.wait(timeout=10), "the event loop was blocked during tokenization"
        return ids

    class SlowTokenizing(ScriptedEngine):
        def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
            return after_the_loop_ran(super().encode("Count:"))

    monkeypatch.setattr(
        "engine.api.served_model.apply_chat_template",
        lambda tok, messages, *flags: after_the_loop_ran(
            tok.encode("Count", add_special_tokens=False)
        ),
    )
    engine = SlowTokenizing(tokenizer, step_delay_s=0.01)
    serving = OpenAIServing(engine)
    long_text = "word " * 1000

    async def run(create, request):
        loop_ran.clear()
        streaming = asyncio.Event()

        async def other_request():
            params = SamplingParams(max_tokens=3)
            async for out in engine.generate([1, 2], params, "other"):
                if len(out.outputs[0].token_ids) == 1:
                    streaming.set()
                else:
                    loop_ran.set()

        other = asyncio.create_task(other_request())
        await streaming.wait()
        response = await create(request)
        await other
        return response

    completion = asyncio.run(
        run(serving.create_completion, _completion(prompt=long_text, max_tokens=2))
    )
    assert completion.usage.prompt_tokens == len(
        tokenizer.encode("Count:", add_special_tokens=False)
    )
    chat_request = _chat(messages=[{"role": "user", "content": long_text}], max_tokens=2)
    chat = asyncio.run(run(serving.create_chat_completion, chat_request))
    assert chat.usage.prompt_tokens == len(tokenizer.encode("Count", add_special_tokens=False))


def test_a_long_prompt_with_nothing_else_in_flight_tokenizes_without_a_thread_hop(tokenizer):
    threads = []

    class Recording(ScriptedEngine):
        def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
            threads.append(threading.current_thread())
            return super().encode("Count:")

    serving = OpenAIServing(Recording(tokenizer))

    async def run():
        await serving.create_completion(_completion(prompt="word " * 1000, max_tokens=2))
        return threading.current_thread()

    assert threads == [asyncio.run(run())]
