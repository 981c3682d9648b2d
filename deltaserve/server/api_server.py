"""The OpenAI-compatible HTTP API (FastAPI): routes, auth, limits and error bodies. The engine runs in its own
process behind `EngineClient`; tokenising, chat rendering, detokenising and output parsing happen here."""

from __future__ import annotations

import hmac
import logging
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..version import __version__
from ..chat import ChatError
from ..engine.sampling_params import InvalidRequestError
from ..errors import RequestFailedError
from .engine_client import EngineDeadError
from .handlers import ClientDisconnected, ServerState, chat_completion, completion
from .leased_response import leased
from .limits import QueueFullError, SequenceLease
from .openapi_doc import openapi_document
from .responses import create_response
from .responses_protocol import ResponsesRequest
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard, ModelList,
                       TokenizeRequest, error_body, validation_error_body)
from .tokenizer_info import TokenizerInfoResponse, tokenizer_info

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def _error(status: int, message: str, type_: str, param: str | None = None, headers: dict | None = None):
    return JSONResponse(error_body(message, type_, param, status), status_code=status, headers=headers)


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.on_outputs = state.metrics_hook
        state.engine.on_restart = state.metrics.on_engine_restart
        await state.engine.start()
        yield
        await state.engine.shutdown()

    app = FastAPI(title="deltaserve", version=__version__, lifespan=lifespan)
    app.state.server = state
    app.openapi = lambda: openapi_document(app, bool(state.api_key))

    expected_auth = f"Bearer {state.api_key}".encode() if state.api_key else None

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """API key on every endpoint but /health, compared in constant time (the time taken does not tell how
        much of a guess was right); request-size cap before the body is parsed."""
        if expected_auth is not None and request.url.path != "/health":
            auth = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(auth, expected_auth):
                return _error(401, "invalid or missing API key", "AuthenticationError")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > state.max_request_bytes:
            return _error(413, f"request body of {length} bytes exceeds the limit of {state.max_request_bytes}",
                          "RequestTooLargeError")
        if (length is None or not length.isdigit()) and request.method in ("POST", "PUT", "PATCH"):
            # No usable Content-Length (e.g. chunked transfer encoding): count the body as it arrives.
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > state.max_request_bytes:
                    return _error(413, f"request body exceeds the limit of {state.max_request_bytes} bytes",
                                  "RequestTooLargeError")
            request._body = bytes(body)  # replayed to the route by BaseHTTPMiddleware
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_request: Request, exc: RequestValidationError):
        status, body = validation_error_body(exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_request: Request, exc: StarletteHTTPException):
        kind = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return _error(exc.status_code, str(exc.detail), kind, headers=exc.headers)  # e.g. a 405's Allow

    @app.exception_handler(APIError)
    async def on_api_error(_request: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.type, exc.param, exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(_request: Request, exc: InvalidRequestError):
        return _error(400, str(exc), "BadRequestError", exc.field)

    @app.exception_handler(ChatError)
    async def on_chat(_request: Request, exc: ChatError):
        return _error(400, str(exc), "BadRequestError", "messages")

    @app.exception_handler(QueueFullError)
    async def on_queue_full(_request: Request, exc: QueueFullError):
        return _error(503, str(exc), "ServiceUnavailableError", headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def on_dead(_request: Request, exc: EngineDeadError):
        return _error(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(RequestFailedError)
    async def on_failed(_request: Request, exc: RequestFailedError):
        return _error(500, str(exc), "InternalServerError")

    @app.exception_handler(ClientDisconnected)
    async def on_gone(_request: Request, _exc: ClientDisconnected):
        return Response(status_code=499)  # nginx's "client closed request"; there is nobody to read it

    def admit(model: str | None, n: int, num_prompts: int, prompt_param: str,
              stop_token_ids: list[int] | None = None) -> SequenceLease:
        """Check what can be checked before tokenising, then reserve the request's sequences in the queue."""
        if model is not None and model not in state.served_names:
            raise APIError(404, f"the model {model!r} does not exist", "NotFoundError", "model")
        if not state.engine.healthy:
            raise APIError(503, "the engine is not running", "ServiceUnavailableError")
        state.limits.check_shape(n, num_prompts, prompt_param)
        for i, token in enumerate(stop_token_ids or ()):
            if token >= state.engine.vocab_size:
                raise InvalidRequestError(f"stop_token_ids.{i}", f"token id {token} is outside the vocabulary "
                                                                 f"[0, {state.engine.vocab_size})")
        return state.queue.take(n * num_prompts, "n" if n > 1 else prompt_param)

    @app.get("/health", response_class=Response, responses={200: {"description": "The engine is running (no body)"}})
    async def health():
        if not state.engine.healthy:
            return _error(503, "the engine is not running", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__, **state.engine.backend}

    @app.get("/v1/models")
    async def models():
        # `root` is the served name, as vLLM shows the model id: where the weights sit on disk is not the
        # clients' business.
        cards = [ModelCard(id=name, created=state.created, owned_by="deltaserve", root=name,
                           max_model_len=state.engine.max_model_len) for name in state.served_names]
        return ModelList(data=cards)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        state.metrics.observe_engine_stats(state.engine.stats)
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/debug/integrity")
    async def integrity():
        """Pool integrity and occupancy, checked inside the engine process (tests, operators)."""
        result = await state.engine.probe()
        return {"ok": result.integrity_error is None, "error": result.integrity_error, "stats": result.stats,
                **result.extra}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        ids = state.prompt_ids_for_tokenize(req)
        out = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
        if req.return_token_strs:  # as vLLM: special names, and BPE tokens in the byte-level string form
            out["token_strs"] = [state.tokenizer.id_to_token(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        bad = [t for t in req.tokens if not 0 <= t < state.tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", "BadRequestError", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse)
    async def get_tokenizer_info():
        return tokenizer_info(state.tokenizer)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        lease = admit(req.model, req.n, len(req.prompts()), "prompt", req.stop_token_ids)
        return await leased(lease, completion(state, req, raw, f"cmpl-{uuid.uuid4().hex}"))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        lease = admit(req.model, req.n, 1, "messages", req.stop_token_ids)
        return await leased(lease, chat_completion(state, req, raw, f"chatcmpl-{uuid.uuid4().hex}"))

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request):
        lease = admit(req.model, 1, 1, "input")
        return await leased(lease, create_response(state, req, raw, f"resp_{uuid.uuid4().hex}"))

    return app

