"""The gRPC API's checked-in Python modules are protoc's output for its proto, and its
messages become the HTTP routes' requests: the same request objects, the same errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from cluster.grpc_api import inference_pb2 as pb
from cluster.grpc_api.messages import (
    generate_body,
    generate_response,
    grpc_status,
    sse_payloads,
    stream_error,
)
from cluster.request_bodies import parse_body
from engine.api.errors import APIError

ROOT = Path(__file__).resolve().parents[2]
PROTO = "cluster/grpc_api/inference.proto"
GENERATED = ("inference_pb2.py", "inference_pb2_grpc.py")


def protoc(out: Path) -> list[str]:
    """The command that writes the modules (run from the repository root; out: `.`)."""
    return [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I",
        ".",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        PROTO,
    ]


def test_the_generated_modules_are_those_of_the_proto(tmp_path):
    subprocess.run(protoc(tmp_path), cwd=ROOT, check=True)
    for name in GENERATED:
        fresh = (tmp_path / "cluster" / "grpc_api" / name).read_text()
        checked_in = (ROOT / "cluster" / "grpc_api" / name).read_text()
        assert fresh == checked_in, f"regenerate: {' '.join(protoc(Path('.')))}"


def _parsed(request: pb.GenerateRequest, stream: bool = False):
    kind, body = generate_body(request, stream)
    return kind, parse_body(json.dumps(body).encode(), kind, 16)


def test_a_prompt_is_a_completion_whose_unset_fields_keep_the_api_defaults():
    kind, parsed = _parsed(pb.GenerateRequest(prompt="hi", temperature=0.7, stop=["."]))
    assert kind == "completion"
    assert (parsed.prompt, parsed.temperature, parsed.stop) == ("hi", 0.7, ["."])
    assert (parsed.max_tokens, parsed.n, parsed.top_p, parsed.seed) == (16, 1, None, None)
    assert parsed.return_token_ids and not parsed.stream


def test_messages_are_a_chat_and_logprobs_its_top_logprobs():
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    kind, parsed = _parsed(pb.GenerateRequest(messages=messages, logprobs=3), stream=True)
    assert kind == "chat"
    assert (parsed.messages[0].role, parsed.messages[0].content) == ("user", "hi")
    assert (parsed.logprobs, parsed.top_logprobs) == (True, 3)
    assert parsed.stream and parsed.stream_options.include_usage
    kind, parsed = _parsed(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2])))
    assert (kind, parsed.prompt) == ("completion", [1, 2])


def test_a_bad_field_is_the_http_route_s_400():
    with pytest.raises(APIError) as error:
        _parsed(pb.GenerateRequest(prompt="hi", n=0))
    assert error.value.param == "n" and error.value.status_code == 400
    with pytest.raises(APIError, match="prompt is required"):
        _parsed(pb.GenerateRequest())


def test_stream_events_become_responses_and_errors_keep_their_status():
    chunk = {
        "id": "cmpl-1",
        "model": "m",
        "created": 5,
        "choices": [{"index": 0, "text": "a", "token_ids": [7], "finish_reason": None}],
    }
    text = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
    (payload,) = sse_payloads(text)
    response = generate_response(payload)
    assert (response.choices[0].text, list(response.choices[0].token_ids)) == ("a", [7])
    assert not response.HasField("usage")
    timeout = APIError("too slow", 408).to_response().model_dump()
    error = stream_error(timeout)
    assert (error.status_code, error.message) == (408, "too slow")
    assert grpc_status(error.status_code) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert grpc_status(APIError("x", 413).status_code) == grpc.StatusCode.INVALID_ARGUMENT
    assert stream_error(chunk) is None
