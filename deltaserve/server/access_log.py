"""The access log: one line per HTTP request once its answer is sent (docs/serving.md §13), instead of uvicorn's.

`AccessLog` wraps the ASGI app. For each HTTP request it opens an `AccessRecord`, notes the status the answer
starts with, and logs the record when the app is done with the request (the last byte of a stream sent, an error
answered, or the client gone). The engine side of the line (token counts, time to first token, finish reasons) is
filled by the handlers' `tracked` stream (server/handlers.py) through `current_record()`: the record travels in a
context variable, so every task a handler starts for the request (a collector, one pump per prompt) reaches the
same record without each endpoint passing it along. Successful /health and /metrics polls are not logged.

Line: `REQUEST_ID METHOD PATH STATUS prompt_tokens=P completion_tokens=C cached_tokens=K ttft=T e2e=E finish=R`,
`-` where a field does not apply (a request refused before it reached the engine has no tokens). TTFT and e2e are
measured from the request's arrival at the server; e2e ends when the answer is sent. STATUS is 499 when the client
went away before an answer began. R lists the finish reasons of the request's completions (stop, length, abort,
error); a completion cut off by a disconnect or a stream that ended early counts as abort.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from ..engine.outputs import RequestOutput

log = logging.getLogger(__name__)

QUIET_PATHS = frozenset({"/health", "/metrics"})  # polled by supervisors and scrapers: logged only when they fail
CLIENT_CLOSED = 499  # no answer was started: the client went away first (nginx's code for it)

_record: ContextVar[AccessRecord | None] = ContextVar("deltaserve_access_record", default=None)


def current_record() -> AccessRecord | None:
    """The access record of the HTTP request the calling task serves; None outside one or with request logging off
    (--disable-log-requests)."""
    return _record.get()


@dataclass
class AccessRecord:
    method: str
    path: str
    arrival: float  # time.monotonic() when the request came in
    request_id: str | None = None  # the id the answer carries; by default the first engine request's
    status: int | None = None
    prompt_tokens: int = 0
    first_token: float | None = None
    engine_requests: int = 0
    finish_reasons: list[str] = field(default_factory=list)  # one per finished engine request
    generated: dict[str, int] = field(default_factory=dict)  # engine request -> tokens so far, all its choices
    cached: dict[str, int] = field(default_factory=dict)  # engine request -> prompt tokens from the prefix cache

    def add_engine_request(self, request_id: str, prompt_tokens: int) -> None:
        self.engine_requests += 1
        self.prompt_tokens += prompt_tokens
        if self.request_id is None:
            self.request_id = request_id

    def on_output(self, request_id: str, out: RequestOutput, now: float) -> None:
        """An engine output of one of the request's engine requests (outputs are cumulative)."""
        if self.first_token is None:
            self.first_token = now
        self.generated[request_id] = sum(len(c.token_ids) for c in out.outputs)
        self.cached[request_id] = out.num_cached_tokens

    def finish_engine_request(self, reason: str) -> None:
        self.finish_reasons.append(reason)

    def line(self, now: float) -> str:
        reasons = list(self.finish_reasons)
        if len(self.finish_reasons) < self.engine_requests and self.status in (200, CLIENT_CLOSED):
            reasons.append("abort")  # never finished, though the answer was not an error: cut off
        engine = self.engine_requests > 0
        ttft = f"{self.first_token - self.arrival:.3f}s" if self.first_token is not None else "-"
        return (f"{self.request_id or '-'} {self.method} {self.path} {self.status} "
                f"prompt_tokens={self.prompt_tokens if engine else '-'} "
                f"completion_tokens={sum(self.generated.values()) if engine else '-'} "
                f"cached_tokens={sum(self.cached.values()) if engine else '-'} "
                f"ttft={ttft} e2e={now - self.arrival:.3f}s finish={','.join(dict.fromkeys(reasons)) or '-'}")


class AccessLog:
    """ASGI middleware around the whole app (outside FastAPI's error handling, so it sees the 500 that answers an
    unhandled exception)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord(scope["method"], scope["path"], time.monotonic())
        token = _record.set(record)

        async def send_noting_status(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        except asyncio.CancelledError:
            record.status = record.status or CLIENT_CLOSED
            raise
        except Exception:
            record.status = record.status or 500
            raise
        finally:
            _record.reset(token)
            if record.status is None:
                record.status = CLIENT_CLOSED
            if not (record.path in QUIET_PATHS and record.status < 400):
                log.info("%s", record.line(time.monotonic()))
