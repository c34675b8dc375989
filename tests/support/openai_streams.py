"""What a client reads of OpenAIServing's server-sent events: the parsed events, and the
choices a client assembles from a chat stream's deltas."""

from __future__ import annotations

import asyncio
import json

from engine.api.protocol import ChatCompletionRequest
from engine.api.serving import SSEStream


async def sse_events(stream: SSEStream) -> list[dict | str]:
    """Each event's JSON payload, and "[DONE]" for the last."""
    out = []
    async for text in stream.events:
        for event in text.split("\n\n"):
            if not event:
                continue
            assert event.startswith("data: ")
            payload = event.removeprefix("data: ")
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def full_and_streamed(serving, request: ChatCompletionRequest):
    """The whole response to `request`, and the events of the same request streamed."""

    async def run():
        full = await serving.create_chat_completion(request)
        streamed = request.model_copy(update={"stream": True})
        return full, await sse_events(await serving.create_chat_completion(streamed))

    return asyncio.run(run())


def streamed_logprobs(events: list, index: int) -> list[dict]:
    """Choice `index`'s token logprobs, from every delta of a stream."""
    return [
        entry
        for chunk in events[:-1]
        for choice in chunk["choices"]
        if choice["index"] == index and choice["logprobs"]
        for entry in choice["logprobs"]["content"]
    ]


def assembled_choices(events: list) -> dict[int, dict]:
    """Per choice, what a client assembles from the deltas: content, calls, finish reason."""
    choices: dict[int, dict] = {}
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            got = choices.setdefault(choice["index"], {"content": "", "calls": {}})
            delta = choice["delta"]
            got["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] not in got["calls"] and call["type"] == "function"
                    got["calls"][call["index"]] = {"id": call["id"], **call["function"]}
                else:
                    assert set(call) == {"index", "function"} and set(call["function"]) == {
                        "arguments"
                    }
                    got["calls"][call["index"]]["arguments"] += call["function"]["arguments"]
            if choice["finish_reason"] is not None:
                got["finish_reason"] = choice["finish_reason"]
    return choices


def assert_stream_agrees(full, events) -> None:
    """The stream's deltas add up to the whole response (ids aside: each response has its own)."""
    streamed = assembled_choices(events)
    for choice in full.choices:
        got = streamed[choice.index]
        calls = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []
        ]
        assert [{k: c[k] for k in ("name", "arguments")} for c in got["calls"].values()] == calls
        assert (got["content"] or None) == (choice.message.content or None)
        assert got["finish_reason"] == choice.finish_reason
