"""Errors as OpenAI's JSON error body: `APIError` carries the HTTP status, and
`validation_error` names the field a request got wrong (`messages[0].role`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from engine.api.responses import ErrorInfo, ErrorResponse


class APIError(Exception):
    """An error with its HTTP status, rendered as OpenAI's error body."""

    _TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        408: "TimeoutError",
        413: "BadRequestError",
        429: "RateLimitError",
        503: "ServiceUnavailableError",
    }

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple:
        # Crosses process boundaries (Serve replicas) with its status intact.
        return (
            APIError,
            (self.message, self.status_code, self.param, self.code, self.retry_after_s),
        )

    def to_response(self) -> ErrorResponse:
        # A client error never reads as the server's fault, named or not.
        fallback = "InvalidRequestError" if self.status_code < 500 else "InternalServerError"
        err_type = self._TYPES.get(self.status_code, fallback)
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=err_type, param=self.param, code=self.code)
        )

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        # Rounded up: a client that waits exactly this long must find room.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def quoted_names(names: Iterable[str]) -> str:
    """`a`, `b`: model names as error messages list them."""
    return ", ".join(f"`{name}`" for name in names)


def model_not_found(model: str, served: Iterable[str]) -> APIError:
    """OpenAI's 404 for a model this server does not serve, naming those it does."""
    return APIError(
        f"The model `{model}` does not exist (this server serves {quoted_names(served)})",
        404,
        param="model",
        code="model_not_found",
    )


def validation_error(e: ValidationError) -> APIError:
    """400 for the first problem pydantic found, naming the field (`messages[0].role`)."""
    errors = e.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        return _json_error(errors[0])
    problem = _first_problem(errors)
    param = _format_loc(tuple(problem[0]["loc"]))
    if problem[0]["type"] == "missing":
        return APIError(f"{param} is required", param=param)
    if problem[0]["type"] == "extra_forbidden":
        return APIError(f"{param} is not a supported field", param=param)
    msg = " or ".join(dict.fromkeys(err["msg"] for err in problem))
    if problem[0]["type"] in ("literal_error", "enum"):
        sent = repr(problem[0]["input"])
        msg += f", got {sent if len(sent) <= 60 else sent[:57] + '...'}"
    return APIError(f"{param}: {msg}", param=param)


def _json_error(error: dict[str, Any]) -> APIError:
    # The JSON parser reports a lone UTF-16 surrogate ("\ud800") as a broken "hex escape";
    # Python's json module reads one, which finds the string that has it.
    if "hex escape" in error["msg"]:
        field = _lone_surrogate_field(error.get("input"))
        if field is not None:
            return APIError(
                f"{field} has a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its "
                "other half): a JSON string must be valid Unicode",
                param=field,
            )
    return APIError(f"the request body is not valid JSON: {error['msg']}")


def _lone_surrogate_field(body: Any) -> str | None:
    """Where in `body` (JSON text) the first string with a lone surrogate is; None when the
    text is not JSON to Python either or has none."""
    try:
        found = _surrogate_path(json.loads(body), "")
    except (TypeError, ValueError, RecursionError):
        return None
    return None if found is None else found or "body"


def _surrogate_path(value: Any, path: str) -> str | None:
    """The path of the first string in `value` with a lone surrogate (an object's own path
    when one of its keys has it)."""
    if isinstance(value, str):
        return path if any("\ud800" <= c <= "\udfff" for c in value) else None
    if isinstance(value, dict):
        if any(_surrogate_path(key, path) is not None for key in value):
            return path
        children = [(f"{path}.{key}" if path else key, item) for key, item in value.items()]
    elif isinstance(value, list):
        children = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    else:
        return None
    for child_path, child in children:
        found = _surrogate_path(child, child_path)
        if found is not None:
            return found
    return None


def _first_problem(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first error, or where it lies in a union, the errors of the member that best fits.

    A union reports one error per member, each with the member's tag in its loc. The member
    that read furthest into the value before its first error is the one the client meant
    (`[1, "a"]` is a list[int] failing at [1], not a str); members tied for furthest, such as
    `str` and `list[...]` both refusing a number, are reported together.
    """
    first = errors[0]
    searched = 0
    while (tag_at := _union_tag_index(first["loc"], searched)) is not None:
        members = _first_error_per_member(errors, tuple(first["loc"][:tag_at]), tag_at)
        furthest = max(_reach(err["loc"][tag_at + 1 :]) for err in members)
        fits = [err for err in members if _reach(err["loc"][tag_at + 1 :]) == furthest]
        if len(fits) > 1:
            return fits
        first = fits[0]
        member_loc = tuple(first["loc"][: tag_at + 1])
        errors = [err for err in errors if tuple(err["loc"][: tag_at + 1]) == member_loc]
        searched = tag_at + 1
    return [first]


def _union_tag_index(loc: tuple, start: int) -> int | None:
    return next((i for i in range(start, len(loc)) if _is_union_tag(loc[i])), None)


def _first_error_per_member(
    errors: list[dict[str, Any]], union_loc: tuple, tag_at: int
) -> list[dict[str, Any]]:
    firsts: dict[str, dict[str, Any]] = {}
    for err in errors:
        loc = tuple(err["loc"])
        if len(loc) > tag_at and loc[:tag_at] == union_loc and _is_union_tag(loc[tag_at]):
            firsts.setdefault(loc[tag_at], err)
    return list(firsts.values())


def _reach(loc_in_member: tuple) -> tuple[int, ...]:
    # Later list items and deeper fields are further in; field names rank alike.
    return tuple(part if isinstance(part, int) else 0 for part in loc_in_member)


def _is_union_tag(part: object) -> bool:
    # Field names are snake_case; member tags are types: "str", "list[int]", "TextContentPart".
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper()
    )


def _format_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if _is_union_tag(part):
            continue  # the union member the value was read as
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"
