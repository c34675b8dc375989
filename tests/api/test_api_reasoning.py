"""Reasoning outputs and chat-template controls in OpenAIServing: a scripted engine writes
a chosen text, read by the server's reasoning_parser (whole and streamed); templates get
the request's chat_template_kwargs; a structured output starts after the thought. The last
test runs the bundled model: the grammar waits for the end of the thought."""

from __future__ import annotations

import asyncio
import copy
import json
import re
from types import SimpleNamespace

import pytest

from engine import LLM
from engine.api.errors import APIError
from engine.api.protocol import ChatCompletionRequest, TokenizeRequest
from engine.api.serving import OpenAIServing
from engine.async_engine import AsyncEngine
from engine.tokenizer import ChatInputError
from tests.support.fakes import HERMES_CALL, WEATHER, TextEngine
from tests.support.openai_streams import (
    assert_stream_agrees,
    full_and_streamed,
    streamed_logprobs,
)

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "The user adds 2 and 2.\nThat is 4, not </thin or <th."
ANSWER = "\n\n2 + 2 = 4."
# Qwen3's way: the generation prompt opens the thought, or with enable_thinking false
# ends it at once.
QWEN_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
# Prints its variables: what chat_template_kwargs set reaches it.
PRINTS_KWARGS = (
    "[{{ greeting }}|{{ mood }}]{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)


def _serving(tokenizer, text: str, reasoning: str | None = "deepseek_r1", **options):
    engine = TextEngine(tokenizer, text)
    return OpenAIServing(engine, reasoning_parser=reasoning, **options), engine


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": ASK, **fields}))


def _streamed_fields(events: list, index: int = 0) -> dict[str, str]:
    """Per field, the text a client assembles from choice `index`'s deltas, and the order
    in which the fields came."""
    got = {"reasoning": "", "reasoning_content": "", "content": "", "order": ""}
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            for name in ("reasoning", "reasoning_content", "content"):
                got[name] += choice["delta"].get(name) or ""
            delta = choice["delta"]
            kind = "r" if "reasoning" in delta else "c" if delta.get("content") else ""
            if kind and not got["order"].endswith(kind):
                got["order"] += kind
    return got


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_thought_comes_in_reasoning_and_the_rest_in_content(tokenizer, parser):
    serving, engine = _serving(tokenizer, f"<think>{THOUGHT}</think>{ANSWER}", parser)
    full, events = full_and_streamed(serving, _chat())
    message = full.choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == (
        THOUGHT,
        THOUGHT,
        ANSWER,
    )
    body = full.model_dump(mode="json")["choices"][0]["message"]
    assert body["reasoning"] == body["reasoning_content"] == THOUGHT  # vLLM's two names
    got = _streamed_fields(events)
    assert (got["reasoning"], got["reasoning_content"], got["content"]) == (
        THOUGHT,
        THOUGHT,
        ANSWER,
    )
    assert got["order"] == "rc"  # the thought first, then the content
    for chunk in events[1:-1]:  # no delta shows a tag, or a piece of one
        delta = chunk["choices"][0]["delta"]
        assert "<think>" not in json.dumps(delta) and "</think>" not in json.dumps(delta)
        assert delta.get("reasoning") == delta.get("reasoning_content")
    assert full.usage.completion_tokens == len(engine.ids)  # the usage counts every token
    assert events[-1] == "[DONE]"


def test_each_format_reads_an_unended_thought_its_own_way(tokenizer):
    serving, _ = _serving(tokenizer, THOUGHT, "deepseek_r1")  # the output starts thinking
    full, events = full_and_streamed(serving, _chat())
    assert (full.choices[0].message.reasoning, full.choices[0].message.content) == (THOUGHT, None)
    assert _streamed_fields(events)["reasoning"] == THOUGHT
    serving, _ = _serving(tokenizer, THOUGHT, "qwen3")  # no thought opened: all content
    full, events = full_and_streamed(serving, _chat())
    assert full.choices[0].message.content == THOUGHT
    assert "reasoning" not in full.model_dump(mode="json")["choices"][0]["message"]
    assert _streamed_fields(events) == {
        "reasoning": "", "reasoning_content": "", "content": THOUGHT, "order": "c"
    }  # fmt: skip


def test_without_a_reasoning_parser_the_thought_stays_content(tokenizer):
    text = f"<think>{THOUGHT}</think>{ANSWER}"
    serving, _ = _serving(tokenizer, text, reasoning=None)
    full, events = full_and_streamed(serving, _chat())
    assert full.choices[0].message.content == text
    assert "reasoning" not in full.model_dump(mode="json")["choices"][0]["message"]
    assert _streamed_fields(events)["content"] == text


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_prompt_that_ended_the_thought_makes_all_of_the_output_content(tokenizer, parser):
    text = "4.</think> <think>no</think>"
    serving, engine = _serving(tokenizer, text, parser, chat_template=QWEN_LIKE)
    fields = {"chat_template_kwargs": {"enable_thinking": False}}
    full, events = full_and_streamed(serving, _chat(**fields))
    assert tokenizer.decode(engine.calls[0]["prompt"]).endswith("<think>\n\n</think>\n\n")
    assert (full.choices[0].message.content, full.choices[0].message.reasoning) == (text, None)
    assert _streamed_fields(events)["content"] == text
    # The template's own generation prompt, opening the thought: the output starts in it.
    serving, engine = _serving(tokenizer, f"{THOUGHT}</think>{ANSWER}", parser)
    serving.chat_template = QWEN_LIKE.replace("assistant\n", "assistant\n<think>\n", 1)
    full, events = full_and_streamed(serving, _chat())
    assert (full.choices[0].message.reasoning, full.choices[0].message.content) == (THOUGHT, ANSWER)
    assert _streamed_fields(events)["order"] == "rc"


def test_tool_calls_are_read_in_the_content_alone(tokenizer):
    thought = f"Maybe {HERMES_CALL} would do; I will call it."
    text = f"<think>{thought}</think>\n{HERMES_CALL}"
    serving = OpenAIServing(
        TextEngine(tokenizer, text),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
    )
    full, events = full_and_streamed(serving, _chat(tools=[WEATHER]))
    choice = full.choices[0]
    assert choice.message.reasoning == thought
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ] == [("get_weather", {"city": "Paris"})]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert_stream_agrees(full, events)
    assert _streamed_fields(events)["reasoning"] == thought
    # A thought that is all the output says so, and has no calls.
    serving.engine = TextEngine(tokenizer, f"<think>{thought}")
    full, _ = full_and_streamed(serving, _chat(tools=[WEATHER]))
    assert full.choices[0].message.reasoning == thought
    assert full.choices[0].message.tool_calls is None


def test_each_of_n_choices_is_split_and_its_logprobs_all_arrive(tokenizer):
    serving, engine = _serving(tokenizer, f"<think>{THOUGHT}</think>{ANSWER}")
    full, events = full_and_streamed(serving, _chat(n=2, logprobs=True))
    for index in (0, 1):
        assert full.choices[index].message.reasoning == THOUGHT
        assert full.choices[index].message.content == ANSWER
        got = _streamed_fields(events, index)
        assert (got["reasoning"], got["content"]) == (THOUGHT, ANSWER)
        # A held-back tag's tokens come later, not never.
        assert len(streamed_logprobs(events, index)) == len(engine.ids)


def test_a_structured_output_starts_after_the_thought(tokenizer):
    end_ids = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    json_format = {"response_format": {"type": "json_object"}}
    named = {
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    for fields in (json_format, {"structured_outputs": {"regex": "[0-9]+"}}, named):
        serving, engine = _serving(tokenizer, '<think>x</think>{"city": "Paris"}', "qwen3")
        full = asyncio.run(serving.create_chat_completion(_chat(**fields)))
        assert engine.calls[0]["params"].structured_output.starts_after_token_ids == end_ids
    assert full.choices[0].message.reasoning == "x"
    assert full.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    # The prompt ended the thought: the grammar applies from the first token.
    serving, engine = _serving(tokenizer, "{}", "qwen3", chat_template=QWEN_LIKE)
    fields = {**json_format, "chat_template_kwargs": {"enable_thinking": False}}
    asyncio.run(serving.create_chat_completion(_chat(**fields)))
    assert engine.calls[0]["params"].structured_output.starts_after_token_ids is None
    serving, engine = _serving(tokenizer, "{}", reasoning=None)
    asyncio.run(serving.create_chat_completion(_chat(**json_format)))
    assert engine.calls[0]["params"].structured_output.starts_after_token_ids is None


def test_chat_template_kwargs_reach_the_template_over_the_servers_defaults(tokenizer):
    serving, engine = _serving(
        tokenizer,
        "ok",
        reasoning=None,
        chat_template=PRINTS_KWARGS,
        default_chat_template_kwargs={"greeting": "Hi", "mood": "calm"},
    )
    asyncio.run(serving.create_chat_completion(_chat(chat_template_kwargs={"greeting": "Hello"})))
    assert tokenizer.decode(engine.calls[0]["prompt"]) == "[Hello|calm]user: What is 2 + 2?\n"
    asyncio.run(serving.create_chat_completion(_chat()))
    assert tokenizer.decode(engine.calls[1]["prompt"]).startswith("[Hi|calm]")
    counted = TokenizeRequest.model_validate(
        {"messages": ASK, "chat_template_kwargs": {"greeting": "Hello"}}
    )
    assert asyncio.run(serving.tokenize(counted)).tokens == engine.calls[0]["prompt"]


@pytest.mark.parametrize(
    "name", ["add_generation_prompt", "continue_final_message", "messages", "tools", "tokenize"]
)
def test_chat_template_kwargs_cannot_override_what_kvray_passes(tokenizer, name):
    serving, engine = _serving(tokenizer, "ok", chat_template=PRINTS_KWARGS)
    param = f"chat_template_kwargs.{name}"
    with pytest.raises(APIError) as info:
        asyncio.run(serving.create_chat_completion(_chat(chat_template_kwargs={name: 1})))
    assert info.value.status_code == 400 and info.value.param == param
    assert f"{param} cannot be set here" in info.value.message
    with pytest.raises(APIError) as info:
        request = TokenizeRequest.model_validate(
            {"messages": ASK, "chat_template_kwargs": {name: 1}}
        )
        asyncio.run(serving.tokenize(request))
    assert info.value.param == param
    assert not engine.calls
    llm = LLM.__new__(LLM)  # the template path alone: no model to load
    llm.engine = SimpleNamespace(tokenizer=tokenizer)
    llm.generate = lambda prompts, params: prompts
    with pytest.raises(ChatInputError, match=re.escape(param)):
        llm.chat(ASK, chat_template_kwargs={name: 1})


def test_offline_chat_passes_chat_template_kwargs(tokenizer):
    qwen_like = copy.deepcopy(tokenizer)
    qwen_like.chat_template = QWEN_LIKE
    llm = LLM.__new__(LLM)  # the template path alone: no model to load
    llm.engine = SimpleNamespace(tokenizer=qwen_like)
    llm.generate = lambda prompts, params: prompts
    (off,) = llm.chat(ASK, chat_template_kwargs={"enable_thinking": False})
    (on,) = llm.chat(ASK)
    assert qwen_like.decode(off).endswith("<think>\n\n</think>\n\n")
    assert qwen_like.decode(on).endswith("<|im_start|>assistant\n")


def test_bad_server_options_fail_at_start_naming_them(tokenizer, tmp_path):
    engine = TextEngine(tokenizer, "x")
    with pytest.raises(
        ValueError, match=r"reasoning_parser must be one of \['deepseek_r1', 'qwen3'\]"
    ):
        OpenAIServing(engine, reasoning_parser="granite")
    with pytest.raises(ValueError, match="chat_template: no such file"):
        OpenAIServing(engine, chat_template=str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ValueError, match="chat_template: the template does not compile"):
        OpenAIServing(engine, chat_template=str(bad))
    with pytest.raises(ValueError, match=r"default_chat_template_kwargs\.tools cannot be set"):
        OpenAIServing(engine, default_chat_template_kwargs={"tools": []})
    good = tmp_path / "good.jinja"
    good.write_text(PRINTS_KWARGS)
    assert OpenAIServing(engine, chat_template=str(good)).chat_template == PRINTS_KWARGS


def test_the_bundled_models_grammar_waits_for_the_end_of_its_thought():
    """SmolLM2 never writes </think>: after a prompt that opens the thought, a regex leaves
    the output free (all of it reasoning); after one that ends it, the regex shapes it all."""
    engine = AsyncEngine.from_engine_args(max_model_len=512, max_num_seqs=2, engine_process=False)
    try:
        serving = OpenAIServing(engine, reasoning_parser="qwen3", chat_template=QWEN_LIKE)
        opened = QWEN_LIKE.replace("assistant\n", "assistant\n<think>\n", 1)
        regex = {"structured_outputs": {"regex": "[0-9]{3}"}, "temperature": 0, "max_tokens": 12}

        def chat(template: str, **fields):
            serving.chat_template = template
            return asyncio.run(serving.create_chat_completion(_chat(**fields))).choices[0].message

        free = chat(opened, temperature=0, max_tokens=12)
        thinking = chat(opened, **regex)
        assert thinking.content is None and thinking.reasoning == free.reasoning
        assert not re.fullmatch("[0-9]{3}", thinking.reasoning)
        answered = chat(QWEN_LIKE, **regex, chat_template_kwargs={"enable_thinking": False})
        assert answered.reasoning is None and re.fullmatch("[0-9]{3}", answered.content)
    finally:
        engine.shutdown()
