"""The server's /openapi.json, made to say what the server really answers.

FastAPI documents a 422 `HTTPValidationError` on every route with a body, but this server answers invalid requests
with 400 and the OpenAI error body; it also answers 401 (API key), 404 (unknown model), 413 (body too large) and 503
(engine down, queue full) with that body, and with --api-key every route but /health needs a bearer token.
`openapi_document` rewrites FastAPI's document accordingly, so clients and property-based testers (schemathesis)
can trust it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .protocol import ErrorResponse

_ERRORS = {
    "400": "Invalid request: malformed body, a bad field value or a per-request limit; `error.param` names the field",
    "401": "Missing or wrong API key (`Authorization: Bearer KEY`)",
    "404": "The requested model is not served",
    "413": "The request body is larger than --max-request-bytes",
    "503": "The engine is not running, or the queue is full (then with Retry-After)",
}
_GENERATION = {"/v1/completions", "/v1/chat/completions", "/v1/responses"}


def _error_statuses(path: str, method: str, api_key: bool) -> list[str]:
    statuses = ["401"] if api_key and path != "/health" else []
    if method == "post":
        statuses += ["400", "413"]
    if path in _GENERATION:
        statuses += ["404", "503"]
    elif path in ("/health", "/debug/integrity"):
        statuses.append("503")
    return statuses


def openapi_document(app: FastAPI, api_key: bool) -> dict[str, Any]:
    """FastAPI's OpenAPI document for `app` with 422 replaced by the error statuses each route can answer, all with
    the OpenAI error body (`ErrorResponse`). Built once and cached on the app, as FastAPI does."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorResponse"] = error_schema
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if api_key:
        doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    error_content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, item in doc.get("paths", {}).items():
        for method, operation in item.items():
            if api_key and path != "/health":
                operation["security"] = [{"apiKey": []}]
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if path in _GENERATION:  # `stream: true` answers with server-sent events
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
            for status in _error_statuses(path, method, api_key):
                responses[status] = {"description": _ERRORS[status], "content": error_content}
    app.openapi_schema = doc
    return doc
