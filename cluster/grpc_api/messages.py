"""kvray.v1's messages as the HTTP API's JSON, and back.

A `GenerateRequest` becomes the JSON body of the HTTP route it stands for (a completion for
a prompt or token ids, a chat completion for messages), which the ingress then parses,
validates and serves exactly as an HTTP body: an unset optional field is left out, so the
API's default applies, and a bad value gets the HTTP route's 400 naming the field. The
answers (a whole response's JSON, a stream's SSE events) become `GenerateResponse`s, and
an `APIError`'s HTTP status a gRPC status code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import grpc

from cluster.grpc_api import inference_pb2 as pb
from engine.api.errors import APIError

GRPC_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
"""An HTTP status as the gRPC status code of the same error (others: INTERNAL)."""

RETRY_AFTER_KEY = "retry-after"
"""Trailing metadata of a RESOURCE_EXHAUSTED or UNAVAILABLE: whole seconds to wait (HTTP's
Retry-After)."""

_STATUS_OF_TYPE = {name: status for status, name in reversed(APIError._TYPES.items())}
"""An OpenAI error body's `type` -> the HTTP status it stands for (a stream's error event
carries the type alone)."""

# Sampling fields that keep their names and JSON types (unset: left out).
_SAME_NAMED = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "priority",
    "add_special_tokens",
)


def grpc_status(status_code: int) -> grpc.StatusCode:
    return GRPC_STATUS.get(status_code, grpc.StatusCode.INTERNAL)


def retry_metadata(error: APIError) -> list[tuple[str, str]]:
    """`error`'s Retry-After as trailing metadata (none without one)."""
    return [(k.lower(), v) for k, v in error.headers().items()]


def _messages(messages: pb.ChatMessages) -> list[dict[str, Any]]:
    out = []
    for message in messages.messages:
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.HasField("name"):
            item["name"] = message.name
        out.append(item)
    return out


def generate_body(request: pb.GenerateRequest, stream: bool) -> tuple[str, dict[str, Any]]:
    """(kind, JSON body): the HTTP request `request` stands for ("completion" or "chat").

    Every response carries token ids (return_token_ids); a stream's last message the usage.
    """
    source = request.WhichOneof("input")
    kind = "chat" if source == "messages" else "completion"
    body: dict[str, Any] = {"return_token_ids": True}
    if request.model:
        body["model"] = request.model
    if source == "messages":
        body["messages"] = _messages(request.messages)
    elif source == "prompt":
        body["prompt"] = request.prompt
    elif source == "prompt_token_ids":
        body["prompt"] = list(request.prompt_token_ids.ids)
    for name in _SAME_NAMED:
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if request.HasField("echo"):
        body["echo"] = request.echo
    if request.HasField("logprobs"):
        if kind == "chat":
            body["logprobs"] = True
            body["top_logprobs"] = request.logprobs
        else:
            body["logprobs"] = request.logprobs
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return kind, body


def tokenize_body(request: pb.TokenizeRequest) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if request.model:
        body["model"] = request.model
    source = request.WhichOneof("input")
    if source == "messages":
        body["messages"] = _messages(request.messages)
    elif source == "prompt":
        body["prompt"] = request.prompt
    if request.HasField("add_special_tokens"):
        body["add_special_tokens"] = request.add_special_tokens
    return body


def request_id_header(request: pb.GenerateRequest) -> dict[str, str]:
    """The request's id as the HTTP header that carries it (none when unset)."""
    return {"x-request-id": request.request_id} if request.HasField("request_id") else {}


def _logprobs(choice: dict[str, Any]) -> list[pb.TokenLogprob]:
    """A choice's logprobs (a completion's lists or a chat's content entries)."""
    logprobs = choice.get("logprobs")
    if not logprobs:
        return []
    if "content" in logprobs:  # a chat's
        return [
            pb.TokenLogprob(
                token=entry["token"],
                logprob=entry["logprob"],
                top_logprobs=[
                    pb.TopLogprob(token=t["token"], logprob=t["logprob"])
                    for t in entry.get("top_logprobs") or ()
                ],
            )
            for entry in logprobs["content"] or ()
        ]
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
    out = []
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], tops):
        out.append(
            pb.TokenLogprob(
                token=token,
                # An echoed prompt's first token has none.
                logprob=math.nan if logprob is None else logprob,
                top_logprobs=[pb.TopLogprob(token=t, logprob=v) for t, v in (top or {}).items()],
            )
        )
    return out


def _choice(choice: dict[str, Any]) -> pb.Choice:
    if "message" in choice:
        text = choice["message"].get("content") or ""
    elif "delta" in choice:
        text = choice["delta"].get("content") or ""
    else:
        text = choice.get("text") or ""
    return pb.Choice(
        index=choice["index"],
        text=text,
        token_ids=choice.get("token_ids") or (),
        finish_reason=choice.get("finish_reason") or "",
        logprobs=_logprobs(choice),
    )


def generate_response(body: dict[str, Any]) -> pb.GenerateResponse:
    """A completion's or a chat completion's JSON (whole, or one streamed chunk)."""
    choices = body.get("choices") or []
    prompt_ids = body.get("prompt_token_ids")
    if prompt_ids is None and choices:
        prompt_ids = choices[0].get("prompt_token_ids")  # a completion's are per choice
    response = pb.GenerateResponse(
        id=body["id"],
        model=body["model"],
        created=body["created"],
        choices=[_choice(c) for c in choices],
        prompt_token_ids=prompt_ids or (),
    )
    usage = body.get("usage")
    if usage:
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=usage["prompt_tokens"],
                completion_tokens=usage["completion_tokens"],
                total_tokens=usage["total_tokens"],
            )
        )
    return response


def sse_payloads(text: str) -> Iterator[dict[str, Any]]:
    """The JSON events of a piece of a server's SSE text (`[DONE]` left out)."""
    for event in text.split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            yield json.loads(event[len("data: ") :])


def stream_error(payload: dict[str, Any]) -> APIError | None:
    """An SSE error event (`{"error": {...}}`) as the APIError it was made from."""
    error = payload.get("error")
    if not isinstance(error, dict):
        return None
    status = _STATUS_OF_TYPE.get(error.get("type"), 500)
    return APIError(error["message"], status, error.get("param"), error.get("code"))
