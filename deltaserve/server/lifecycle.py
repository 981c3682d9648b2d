"""The uvicorn server with deltaserve's shutdown rules.

* SIGTERM / SIGINT drain: new connections are refused at once; requests in flight get `drain_s` seconds to finish
  normally; at that deadline the ones still running are ended with an OpenAI-shaped 503 (a JSON body, or an error
  event then [DONE] on a stream), and uvicorn is given `DRAIN_GRACE_S` more seconds to write those answers before it
  cancels what is left.
* Engine restarts exhausted (EngineClient.on_fatal): the server shuts down and `exit_code` is 1, so a supervisor
  restarts the whole process rather than keep a server that can only answer 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import uvicorn

from .engine_client import EngineClient, ServerDrainTimeoutError

log = logging.getLogger(__name__)
DRAIN_GRACE_S = 3.0  # for the error answers of requests failed at the drain deadline


class DeltaserveServer(uvicorn.Server):
    """`on_listening(url)` is called once, when start-up has finished: the engine is ready (the app's lifespan
    waited for it) and the socket is bound."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, drain_s: float,
                 on_listening: Callable[[str], None] | None = None):
        config.timeout_graceful_shutdown = drain_s + DRAIN_GRACE_S
        super().__init__(config)
        self.engine, self.drain_s, self.on_listening = engine, drain_s, on_listening
        self.exit_code = 0
        engine.on_fatal = self.stop_on_engine_failure

    def stop_on_engine_failure(self) -> None:
        self.exit_code = 1
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_listening is not None:
            self.on_listening(self.url())

    def url(self) -> str:
        """http://HOST:PORT as configured, with the port actually bound (a --port of 0 picks a free one)."""
        port = self.servers[0].sockets[0].getsockname()[1]
        host = self.config.host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def shutdown(self, sockets=None) -> None:
        log.info("shutting down: %d requests in flight get up to %g s to finish", self.engine.num_in_flight,
                 self.drain_s)
        deadline = asyncio.get_running_loop().call_later(self.drain_s, self._end_drain)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _end_drain(self) -> None:
        failed = self.engine.fail_in_flight(ServerDrainTimeoutError(
            f"the server is shutting down and the request did not finish within {self.drain_s:g} s"))
        if failed:
            log.warning("drain time of %g s is over: ended %d requests with 503", self.drain_s, failed)
