"""A response that holds a `SequenceLease` (limits.py) until it has been sent."""

from __future__ import annotations

from collections.abc import Awaitable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .limits import SequenceLease


class ReleasingResponse(Response):
    """Sends `inner`, then releases `lease` however sending ends: finished, failed, or cancelled because the client
    went away. A streamed response holds its sequences until its last event, not just until the route returns."""

    def __init__(self, inner: Response, lease: SequenceLease) -> None:
        self.inner, self.lease = inner, lease
        self.status_code, self.raw_headers, self.background = inner.status_code, inner.raw_headers, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.lease.release()


async def leased(lease: SequenceLease, pending: Awaitable[Response]) -> Response:
    """The response `pending` resolves to, holding `lease` until it is sent; the lease is released at once if
    building the response fails."""
    try:
        response = await pending
    except BaseException:
        lease.release()
        raise
    return ReleasingResponse(response, lease)
