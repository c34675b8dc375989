"""The admin API of the model lifecycle, on the ingress: `/v1/admin/*` routes, their keys, and
the rolling switch across a model's replicas.

Routes (HTTP only; the gRPC API has no admin methods):
- `POST /v1/admin/load_model {"model": path, "weights_only": false, "served_model_name": ...}`
- `POST /v1/admin/sleep {"level": 1}`, `POST /v1/admin/wake_up`,
  `GET /v1/admin/is_sleeping`, `POST /v1/admin/reset_prefix_cache`
`served_model_name` (any POST's body) picks one of the app's models; without it, load_model
needs an app of one model and the others act on every model.

Keys: off unless `admin_api_keys` is set (the routes answer 404 as any unknown path); then
`Authorization: Bearer <admin key>`, a user's key (`api_keys`) gets 403, none or another
401, in OpenAI's error shape.

The rolling switch: Serve's handle `broadcast` reaches every running replica of a deployment
(its router picks one for `remote`). The ingress asks each replica its id, then, for one id
after another, broadcasts the step: only the replica of that id drains, loads, warms up and
serves again (cluster/replica_lifecycle.py) while the others serve, and the next begins once
it answers. The first replica that fails stops the roll and its error is the answer (a bad
checkpoint fails on the first replica; the old model serves on); the replicas switched
before it keep the new model, and the answer names them. A replica that Serve starts later
(a restart, autoscaling) loads the app's configured model, not the switched one.
Sleep, wake-up and the prefix-cache reset go to every replica at once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from cluster.http_app import error_response
from cluster.local_server import LocalServer
from cluster.model_router import ModelRouter
from cluster.request_bodies import read_body
from engine.api.errors import APIError, quoted_names

ADMIN_PREFIX = "/v1/admin/"
CLIENT_GONE = 499
"""A request whose client went away (as the ingress counts it)."""


class AdminAuth:
    """Who may call the admin routes."""

    def __init__(self, admin_keys: list[str], user_keys: Mapping[str, str]) -> None:
        self.admin_keys = frozenset(admin_keys)
        self.user_keys = frozenset(user_keys)

    @property
    def enabled(self) -> bool:
        return bool(self.admin_keys)

    def check(self, method: str, path: str, headers: Mapping[str, str]) -> None:
        """APIError unless the request carries an admin key: 404 while the admin API is off,
        403 for a user's key, 401 for none or another."""
        if not self.enabled:
            raise APIError(f"Not Found: {method} {path}", 404, code="not_found")
        scheme, _, key = headers.get("authorization", "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        if key in self.admin_keys:
            return
        if key in self.user_keys:
            raise APIError(
                "this key may not call the admin API: send an admin key (admin_api_keys)",
                403,
                code="permission_denied",
            )
        raise APIError(
            "missing or invalid admin key: send `Authorization: Bearer <admin key>`",
            401,
            code="invalid_api_key",
        )


class _AdminBody(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    served_model_name: str | None = None
    """The served model to act on (one of the app's names or aliases)."""


class LoadModelBody(_AdminBody):
    model: str = Field(min_length=1)
    """The checkpoint to serve: a folder, a .gguf file."""
    weights_only: bool = False


class SleepBody(_AdminBody):
    level: Literal[1, 2] = 1


ADMIN_OPERATIONS = (
    ("POST", "load_model"),
    ("POST", "sleep"),
    ("POST", "wake_up"),
    ("GET", "is_sleeping"),
    ("POST", "reset_prefix_cache"),
)
"""(HTTP method, operation): each route is ADMIN_PREFIX + operation."""

ADMIN_BODIES: dict[str, type[_AdminBody]] = {
    "load_model": LoadModelBody,
    "sleep": SleepBody,
    "wake_up": _AdminBody,
    "reset_prefix_cache": _AdminBody,
}


def parse_admin_body(operation: str, body: bytes) -> _AdminBody:
    """The body of `operation` (an empty body: the defaults); APIError 400 naming the field."""
    try:
        data = json.loads(body) if body.strip() else {}
    except json.JSONDecodeError as e:
        raise APIError(f"the body is not valid JSON: {e}") from None
    try:
        return ADMIN_BODIES[operation].model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        raise APIError(f"{field}: {first['msg']}", param=field) from None


class ModelAdmin:
    """The lifecycle operations over each served model's replicas (`servers`: served name ->
    LLMServer handle, or a LocalServer under colocate_ingress: its one engine)."""

    def __init__(
        self, servers: Mapping[str, Any], router: ModelRouter, auth: AdminAuth, max_body: int
    ) -> None:
        self.servers = dict(servers)
        self.router = router
        self.auth = auth
        self.max_body = max_body

    def models_of(self, served_model_name: str | None) -> list[str]:
        if served_model_name is None:
            return list(self.servers)
        return [self.router.name_for(served_model_name)]

    async def respond(self, request: Request, operation: str) -> Response:
        """An admin route's answer: its key checked, its body read, the operation run on the
        model's replicas; errors in OpenAI's shape."""
        try:
            self.auth.check(request.method, request.url.path, request.headers)
            body = None
            if operation in ADMIN_BODIES:
                raw = await read_body(request, self.max_body)
                body = parse_admin_body(operation, raw)
            if operation == "load_model":
                try:
                    result = await self.load_model(body)
                finally:
                    self.router.forget_models()
            elif operation == "is_sleeping":
                models = await self.on_every_replica("is_sleeping", None)
                asleep = all(r["is_sleeping"] for found in models.values() for r in found)
                result = {"is_sleeping": asleep, "models": models}
            else:
                args = (body.level,) if operation == "sleep" else ()
                models = await self.on_every_replica(operation, body.served_model_name, *args)
                result = {"models": models}
        except APIError as e:
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(result)

    async def load_model(self, body: LoadModelBody) -> dict:
        if body.served_model_name is None and len(self.servers) > 1:
            raise APIError(
                f"this app serves several models ({quoted_names(self.servers)}): name one in "
                "`served_model_name`",
                param="served_model_name",
            )
        name = self.models_of(body.served_model_name)[0]
        server = self.servers[name]
        ids = sorted(
            replica for replica, _ in await _broadcast(server, "admin", None, "replica_id")
        )
        switched: list[str] = []
        for replica in ids:
            answers = await _broadcast(
                server, "admin", replica, "load_model", body.model, body.weights_only
            )
            result = next((r for rid, r in answers if rid == replica), None)
            if isinstance(result, APIError):
                if switched:
                    result.message += f" (replicas switched before it: {', '.join(switched)})"
                    result.args = (result.message,)
                raise result
            if result is not None:  # None: the replica went away meanwhile
                switched.append(replica)
        return {
            "served_model_name": name,
            "model": body.model,
            "weights_only": body.weights_only,
            "replicas": switched,
        }

    async def on_every_replica(self, operation: str, served_model_name: str | None, *args) -> dict:
        """`operation` on every replica of the named model (or of each): per served name,
        the replicas' answers; the first APIError is raised."""
        out: dict[str, list] = {}
        for name in self.models_of(served_model_name):
            answers = await _broadcast(self.servers[name], "admin", None, operation, *args)
            for _, result in answers:
                if isinstance(result, APIError):
                    raise result
            out[name] = [{"replica": rid, **result} for rid, result in answers]
        return out


async def _broadcast(server: Any, method: str, *args: Any) -> list:
    """`method(*args)` on every replica of `server`: their answers (a replica's exception is
    raised)."""
    if isinstance(server, LocalServer):  # this process's engine
        return [await getattr(server.host, method)(*args)]
    return await server.broadcast(method, *args).results_async()
