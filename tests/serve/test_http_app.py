"""The ingress's HTTP app without Ray: generation POSTs go straight to their handler, every
other request through FastAPI, and both answer errors in OpenAI's shape."""

import asyncio

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from cluster.http_app import ClosingStreamingResponse, HotRoutes, build_fastapi_app


class _Unavailable(Exception):
    pass


async def _completions(request: Request) -> JSONResponse:
    body = await request.body()
    if body == b"boom":
        raise RuntimeError("handler failed")
    if body == b"busy":
        raise _Unavailable("no replica")
    if body == b"stream":

        async def events():
            yield "data: 1\n\n"
            yield "data: [DONE]\n\n"

        return ClosingStreamingResponse(events(), media_type="text/event-stream")
    return JSONResponse({"bytes": len(body), "tenant": request.headers.get("x-tenant-id")})


async def _models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": []})


def _app() -> tuple[HotRoutes, list[str]]:
    calls: list[str] = []

    async def hot(request: Request):
        calls.append(request.url.path)
        return await _completions(request)

    fallback = build_fastapi_app(
        {("POST", "/v1/completions"): _completions, ("GET", "/v1/models"): _models}
    )
    return HotRoutes({"/v1/completions": hot}, fallback), calls


def _call(app: HotRoutes, method: str, url: str, root_path: str = "", **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvray") as client:
            return await client.request(method, url, **kw)

    return asyncio.run(go())


def test_generation_posts_reach_their_handler_with_body_and_headers():
    app, calls = _app()
    r = _call(app, "POST", "/v1/completions", content=b"x" * 6000, headers={"X-Tenant-Id": "a"})
    assert r.status_code == 200
    assert r.json() == {"bytes": 6000, "tenant": "a"}
    assert calls == ["/v1/completions"]


def test_a_streamed_response_from_the_direct_route_is_sse():
    app, _ = _app()
    r = _call(app, "POST", "/v1/completions", content=b"stream")
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text == "data: 1\n\ndata: [DONE]\n\n"


def test_under_a_route_prefix_the_direct_route_still_matches():
    app, calls = _app()
    r = _call(app, "POST", "/kvray/v1/completions", root_path="/kvray", content=b"abc")
    assert r.status_code == 200 and r.json()["bytes"] == 3
    assert calls == ["/kvray/v1/completions"]


def test_other_routes_and_methods_go_through_fastapi():
    app, calls = _app()
    assert _call(app, "GET", "/v1/models").json() == {"object": "list", "data": []}
    wrong_method = _call(app, "GET", "/v1/completions")
    assert wrong_method.status_code == 405
    assert "Method Not Allowed" in wrong_method.json()["error"]["message"]
    # A client's mistake, not the server's: the openai client reads the type as it is.
    assert wrong_method.json()["error"]["type"] == "MethodNotAllowedError"
    missing = _call(app, "POST", "/v1/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    assert calls == []


def test_a_failing_handler_is_a_500_in_openai_shape():
    app, _ = _app()
    r = _call(app, "POST", "/v1/completions", content=b"boom")
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "internal error: RuntimeError"


def test_handlers_registered_on_the_app_apply_to_both_paths():
    """Serve adds its own (a 503 for an unavailable deployment) once the app is built."""
    app, _ = _app()
    app.add_exception_handler(_Unavailable, lambda request, exc: PlainTextResponse("busy", 503))

    async def busy_models(request: Request) -> JSONResponse:
        raise _Unavailable("no replica")

    app.fallback.add_api_route("/busy", busy_models, methods=["GET"])
    hot = _call(app, "POST", "/v1/completions", content=b"busy")
    assert (hot.status_code, hot.text) == (503, "busy")
    routed = _call(app, "GET", "/busy")
    assert (routed.status_code, routed.text) == (503, "busy")


def test_a_405_names_the_methods_the_path_takes_in_allow():
    app, _ = _app()
    wrong_method = _call(app, "GET", "/v1/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["type"] == "MethodNotAllowedError"
