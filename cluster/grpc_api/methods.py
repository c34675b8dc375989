"""kvray.v1.InferenceService as methods of the ingress deployment (cluster/ingress.py).

Ray Serve's gRPC proxy calls a deployment's method named like the RPC, with the request
message and its `grpc_context`. Each method builds the HTTP route's JSON body from the
message (messages.py) and runs it through the ingress's own request path (`run_generation`,
`run_tokenizer_call`): the same tenant and API key (from the `authorization` and
`x-tenant-id` metadata), limits, time limit, validation and serving, so an error has the
HTTP route's message, under the gRPC status code of its HTTP status.

How an error travels back through Serve: a unary method sets the code, details and
trailing metadata (Retry-After) on `grpc_context` and returns an empty message, and Serve
sends them with it; a streaming method sets the code and details and raises (Serve keeps
those two from a raising method, not its trailing metadata, and sends a context only with
a message, which an error before the first one has not). A client that cancels a stream
has its request's task cancelled: the stream's `finally` aborts the engine's request.
"""

# No `from __future__ import annotations`: Serve reads these methods' signatures (it passes
# `grpc_context` to a method with a parameter of that name), and FastAPI the ingress's.
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from ray.serve.grpc_util import RayServegRPCContext

from cluster.grpc_api import inference_pb2 as pb
from cluster.grpc_api.messages import (
    generate_body,
    generate_response,
    grpc_status,
    request_id_header,
    retry_metadata,
    sse_payloads,
    stream_error,
    tokenize_body,
)
from cluster.request_bodies import body_too_large, parse_body
from cluster.server_calls import GenerationReplies, ServerStream
from engine.api.errors import APIError


class _OpenStream:
    """A stream the ingress has started: the server's stream and what ends it."""

    def __init__(self, stream: ServerStream, on_close: Callable[[], None]) -> None:
        self.stream = stream
        self.on_close = on_close


GRPC_REPLIES = GenerationReplies(error=lambda e: e, whole=generate_response, stream=_OpenStream)
"""A generation request's answers, for the RPC methods to send: an APIError, a whole
GenerateResponse, or an `_OpenStream`."""


def _set_error(context: RayServegRPCContext, error: APIError) -> None:
    context.set_code(grpc_status(error.status_code))
    context.set_details(error.message)
    context.set_trailing_metadata(retry_metadata(error))


def _metadata(
    context: RayServegRPCContext, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The call's metadata as the HTTP path reads headers (lower-case keys)."""
    return {**{k.lower(): v for k, v in context.invocation_metadata()}, **(extra or {})}


class GrpcMethods:
    """The RPCs of kvray.v1.InferenceService (inference.proto), mixed into OpenAIIngress."""

    def _grpc_body(self, body: dict[str, Any], kind: str) -> Callable[[], Any]:
        """`parse` for the request path: the message's JSON body parsed as HTTP's is."""

        async def parse() -> Any:
            data = json.dumps(body).encode()
            limit = self.config.max_request_body_bytes
            if len(data) > limit:
                raise body_too_large(limit)
            return parse_body(data, kind, self.config.max_completion_prompts)

        return parse

    async def Generate(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> pb.GenerateResponse:
        kind, body = generate_body(request, stream=False)
        headers = _metadata(grpc_context, request_id_header(request))
        answer = await self.run_generation(headers, self._grpc_body(body, kind), kind, GRPC_REPLIES)
        if isinstance(answer, _OpenStream):  # not asked for: never sent unstreamed
            answer.on_close()
            answer = APIError("the server streamed an unstreamed request", 500)
        if isinstance(answer, APIError):
            _set_error(grpc_context, answer)
            return pb.GenerateResponse()
        return answer

    async def GenerateStream(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        kind, body = generate_body(request, stream=True)
        headers = _metadata(grpc_context, request_id_header(request))
        answer = await self.run_generation(headers, self._grpc_body(body, kind), kind, GRPC_REPLIES)
        if isinstance(answer, APIError):
            _set_error(grpc_context, answer)
            raise answer
        if isinstance(answer, pb.GenerateResponse):
            yield answer
            return
        try:
            async for text in answer.stream.events():
                for payload in sse_payloads(text):
                    error = stream_error(payload)
                    if error is not None:
                        _set_error(grpc_context, error)
                        raise error
                    yield generate_response(payload)
        finally:
            answer.on_close()

    async def Tokenize(
        self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext
    ) -> pb.TokenizeResponse:
        parse = self._grpc_body(tokenize_body(request), "tokenize")
        try:
            result = await self.run_tokenizer_call(_metadata(grpc_context), parse, "tokenize")
        except APIError as e:
            _set_error(grpc_context, e)
            return pb.TokenizeResponse()
        return pb.TokenizeResponse(
            tokens=result["tokens"], count=result["count"], max_model_len=result["max_model_len"]
        )

    async def Models(
        self, request: pb.ModelsRequest, grpc_context: RayServegRPCContext
    ) -> pb.ModelsResponse:
        try:
            self.resolver.resolve(_metadata(grpc_context))
        except APIError as e:
            _set_error(grpc_context, e)
            return pb.ModelsResponse()
        cards = (await self.router.models())["data"]
        return pb.ModelsResponse(
            models=[
                pb.Model(
                    id=card["id"],
                    max_model_len=card.get("max_model_len") or 0,
                    owned_by=card["owned_by"],
                    quantization=card.get("quantization", ""),
                )
                for card in cards
            ]
        )

    async def Health(
        self, request: pb.HealthRequest, grpc_context: RayServegRPCContext
    ) -> pb.HealthResponse:
        down = await self.down_models()
        if down:
            _set_error(grpc_context, self.unhealthy(down))
            return pb.HealthResponse(status="unhealthy", models=down)
        return pb.HealthResponse(status="healthy", models=self.router.names)
