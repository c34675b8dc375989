"""The request bodies of the ingress's POST routes: read within the app's size limit,
parsed into the protocol's models (engine/api/protocol.py), and published in /openapi.json.

The routes read the raw body and parse it themselves: a body over the limit is a 413
before it is read, and a bad one a 400 naming the field (engine/api/errors.py). FastAPI
therefore sees no body parameter on them; `publish_request_bodies` names each route's
model as its request body in the OpenAPI document instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from engine.api.errors import APIError, validation_error
from engine.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "completion": CompletionRequest,
    "chat": ChatCompletionRequest,
    "tokenize": TokenizeRequest,
    "detokenize": DetokenizeRequest,
}
"""The request model of each kind of POST the ingress takes."""

_SCHEMA_REF = "#/components/schemas/{model}"


def body_too_large(limit: int) -> APIError:
    return APIError(f"request body is larger than {limit} bytes", 413)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; APIError 413 once it passes `limit` bytes (or says it will)."""
    too_large = body_too_large(limit)
    length = request.headers.get("content-length")
    # isdecimal() alone passes non-ASCII digits that int() may refuse ("²").
    if length is not None and length.isascii() and length.isdecimal() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def parse_body(body: bytes, kind: str, max_completion_prompts: int) -> Any:
    """`body` as `kind`'s request model; APIError 400 naming the field if it is not one."""
    try:
        parsed = REQUEST_MODELS[kind].model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None
    limit = max_completion_prompts
    if kind == "completion" and parsed.several_prompts and len(parsed.prompt) > limit:
        raise APIError(
            f"prompt holds {len(parsed.prompt)} prompts; this server takes at most {limit} "
            "in one request (max_completion_prompts)",
            param="prompt",
        )
    return parsed


def publish_request_bodies(app: FastAPI, bodies: Mapping[str, type[BaseModel]]) -> None:
    """Make `app`'s OpenAPI document name `bodies` (path -> model) as the JSON request
    bodies of those paths' POST operations, each model a schema under components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            schema = model.model_json_schema(ref_template=_SCHEMA_REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            document["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                    }
                },
            }
        app.openapi_schema = document
        return document

    app.openapi = openapi
