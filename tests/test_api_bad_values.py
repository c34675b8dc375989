"""Every request field, given values of the wrong type, sign or size, through the real
engine: each request is answered (a 4xx naming a problem, or served), never a 5xx or an
exception, and the engine keeps serving. The lists of fields come from the request models,
so a field added later is covered without being named here."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from engine.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from engine.api.serving import OpenAIServing, RequestContext
from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams

# JSON texts, not Python values: NaN, Infinity and integers past 64 bits reach the parser.
BAD_VALUES = [
    "null", "-1", "0", "2147483648", "9223372036854775808", "1e308", "-1e308", "-0.5",
    "NaN", "Infinity", "true", '""', '"x"', "[]", "{}", "[-1]", "[99999999]", "[[]]",
    '{"99999999": 5}', '{"1": NaN}', '"' + "a" * 3000 + '"',
]  # fmt: skip
BASES = {
    "completion": (CompletionRequest, {"prompt": "Hi", "max_tokens": 1}),
    "chat": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
}  # fmt: skip


@pytest.fixture(scope="module")
def served():
    engine = AsyncEngine.from_engine_args(max_model_len=128, max_num_seqs=8, engine_process=False)
    yield OpenAIServing(engine), engine
    engine.shutdown()


def _bodies(kind: str) -> list[str]:
    model, base = BASES[kind]
    bodies = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        rest = json.dumps({k: v for k, v in base.items() if k != key})
        for value in BAD_VALUES:
            bodies.append(f'{rest[:-1]}, "{key}": {value}}}')
    return bodies


async def _answer(serving: OpenAIServing, kind: str, body: str) -> int:
    model, _ = BASES[kind]
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        return validation_error(e).status_code
    create = serving.create_completion if kind == "completion" else serving.create_chat_completion
    try:
        response = await asyncio.wait_for(create(request, RequestContext()), 30)
        if hasattr(response, "events"):
            text = "".join([event async for event in response.events])
            assert '"error"' not in text, f"{body[:200]}: {text[-300:]}"
    except APIError as e:
        return e.status_code
    return 200


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_no_field_value_breaks_a_request_or_the_engine(served, kind):
    serving, engine = served

    async def run() -> dict[str, int]:
        return {body: await _answer(serving, kind, body) for body in _bodies(kind)}

    statuses = asyncio.run(run())
    server_errors = {body[:200]: s for body, s in statuses.items() if s >= 500}
    assert not server_errors
    refused = sum(400 <= s < 500 for s in statuses.values())
    assert refused > len(statuses) // 2, "most of these values are wrong for their field"
    assert engine.is_healthy

    async def four_tokens() -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outputs = [o async for o in engine.generate("The capital of France is", params, "after")]
        return outputs[-1].outputs[0].token_ids

    assert len(asyncio.run(four_tokens())) == 4
