"""`deltaserve router --prefill URL... --decode URL...` (docs/disaggregation.md §5): an OpenAI-compatible front for
prefill/decode disaggregation. Each completions or chat request goes first to a prefill instance (a kv_producer) as
a one-token, non-streaming request with kv_transfer_params {"do_remote_decode": true}; the kv_transfer_params it
answers with go, with the client's request unchanged otherwise, to a decode instance (a kv_consumer), whose answer —
streamed or not — is the client's. Each step picks the instance of its kind with the fewest requests in flight
(ties: the first listed). An error answer from either instance is passed on as it is (status and OpenAI-style body);
an instance that cannot be reached is a 502 naming it.

The router holds no model: /v1/models is the first decode instance's. It listens on 127.0.0.1 by default; with
--api-key it requires the key on all but /health, and it passes the client's Authorization header on to the
instances."""

from __future__ import annotations

import argparse
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

MAX_BODY_BYTES = 64 << 20


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)


class Pool:
    """The instances of one kind and the requests each has in flight."""

    def __init__(self, urls: list[str]):
        self.urls = [u.rstrip("/") for u in urls]
        self.in_flight = {u: 0 for u in self.urls}

    def pick(self) -> str:
        return min(self.urls, key=lambda u: self.in_flight[u])


def build_router_app(prefill: list[str], decode: list[str], api_key: str | None = None,
                     timeout_s: float = 600.0) -> FastAPI:
    prefills, decodes = Pool(prefill), Pool(decode)
    expected_auth = f"Bearer {api_key}".encode() if api_key else None
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="deltaserve router", lifespan=lifespan)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if expected_auth is not None and request.url.path != "/health":
            if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected_auth):
                return _error(401, "invalid or missing API key", "AuthenticationError")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return _error(413, f"request body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}",
                          "RequestTooLargeError")
        return await call_next(request)

    def forwarded(request: Request) -> dict:
        auth = request.headers.get("authorization")
        return {"authorization": auth} if auth else {}

    @app.get("/health")
    async def health():
        for url in prefills.urls + decodes.urls:
            try:
                if (await client.get(url + "/health", timeout=5.0)).status_code != 200:
                    return _error(503, f"instance {url} is not healthy", "ServiceUnavailableError")
            except httpx.HTTPError:
                return _error(503, f"instance {url} cannot be reached", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request):
        url = decodes.urls[0]
        try:
            answer = await client.get(url + "/v1/models", headers=forwarded(request))
        except httpx.HTTPError as exc:
            return _error(502, f"decode instance {url} cannot be reached: {exc}", "BadGatewayError")
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    async def route(request: Request, path: str):
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return _error(400, f"the request body is not JSON: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "BadRequestError")
        first = dict(body, stream=False, n=1, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        url = prefills.pick()
        prefills.in_flight[url] += 1
        try:
            answer = await client.post(url + path, json=first, headers=forwarded(request))
        except httpx.HTTPError as exc:
            return _error(502, f"prefill instance {url} cannot be reached: {exc}", "BadGatewayError")
        finally:
            prefills.in_flight[url] -= 1
        if answer.status_code != 200:
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        kv = answer.json().get("kv_transfer_params")
        if not isinstance(kv, dict):
            return _error(502, f"prefill instance {url} returned no kv_transfer_params (is it a kv_producer?)",
                          "BadGatewayError")
        second = dict(body, kv_transfer_params=kv)
        url = decodes.pick()
        decodes.in_flight[url] += 1
        try:
            upstream = await client.send(client.build_request("POST", url + path, json=second,
                                                              headers=forwarded(request)), stream=True)
        except httpx.HTTPError as exc:
            decodes.in_flight[url] -= 1
            return _error(502, f"decode instance {url} cannot be reached: {exc}", "BadGatewayError")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                decodes.in_flight[url] -= 1

        return StreamingResponse(relay(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type", "application/json"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await route(request, "/v1/chat/completions")

    return app


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(build_router_app(args.prefill, args.decode, args.api_key), host=args.host, port=args.port,
                log_level="warning")
    return 0
