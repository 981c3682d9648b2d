"""Connection limits of `deltaserve serve`: a header-read timeout, the keep-alive timeout and a cap on open
connections, enforced by an h11 protocol that uvicorn builds for every accepted connection.

The behaviour (what tests/test_connections.py checks):

* **Header timeout** (`--timeout-header`): a connection must deliver a complete request head within that many seconds
  of being opened, or of the end of its previous response. Bytes that trickle in do not extend it (unlike the
  keep-alive timer, which any byte cancels). On expiry a connection that sent part of a head gets a 408 with an
  OpenAI error body and `Connection: close`; one that sent nothing is closed without a word. The body is not
  covered: once the head has arrived the request belongs to the application.
* **Keep-alive timeout** (`--timeout-keep-alive`, uvicorn's own): a connection idle after a response is closed after
  that many seconds unless a byte arrives.
* **Connection cap** (`--max-connections`): at most that many connections are open. A connection that arrives at
  the cap closes the one that has waited longest for a request head (a fresh connection, or a keep-alive one idle
  after its response); connections whose request is being read or answered are never closed for it. Only when
  every open connection is busy with a request is the new connection refused (closed at once, before it sends
  anything). Clients that hold connections without sending requests thus lose their own connections first and
  cannot lock normal clients out. A client that sends a head and then stalls its body holds a busy connection:
  that is bounded by the cap, not by a timeout.
* **Report**: closures at the cap, refusals and header timeouts are counted and logged at most once per
  `REPORT_INTERVAL_S`, as one line with the counts since the previous line (WARNING when the cap was reached,
  INFO when only header timeouts happened), so a flood of connections cannot flood the log.
* **File descriptors**: `connection_options` raises the soft RLIMIT_NOFILE to the hard limit and lowers the cap
  (with a warning) when the cap, the accept bursts and the process's own files would not fit under it, so the
  server never runs out of descriptors ("Too many open files") however many clients connect.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from ..errors import DeltaserveError
from .protocol import error_body

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 5.0
# Descriptors kept for everything but client connections: the engine's ZeroMQ sockets, the model and tokenizer
# files, shared libraries, logs.
FD_RESERVE = 256
# uvicorn's default listen backlog; asyncio accepts up to `backlog` sockets per wake-up.
DEFAULT_BACKLOG = 2048
# Accept bursts that can be open beyond the cap before the connections they displace are gone (`fit_to_open_files`).
ACCEPT_BURSTS = 4
# The soft limit asked for when the hard one is unlimited (Linux refuses more than fs.nr_open, 1 Mi by default).
UNLIMITED_NOFILE_TARGET = 1 << 20


class ConnectionLimitError(DeltaserveError, ValueError):
    """A connection flag is out of range, or the process may open too few files to serve any connection."""


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits one server applies: seconds to a complete request head, seconds idle after a response, open
    connections at most (already fitted to the file-descriptor limit)."""
    timeout_header: float
    timeout_keep_alive: float
    max_connections: int


class ClosureReport:
    """Counts connections closed or refused by the limits and logs the counts at most once per `interval_s`.

    The first event after a quiet spell is logged at once; later ones are gathered and logged by a timer when the
    interval since the previous line has passed, so no count is lost and no more than one line per interval is
    written. Runs on the server's event loop."""

    def __init__(self, limits: ConnectionLimits, interval_s: float = REPORT_INTERVAL_S):
        self.limits = limits
        self.interval_s = interval_s
        self.evicted = self.refused = self.timed_out = 0
        self.last_line_at: float | None = None
        self.flush_timer: asyncio.TimerHandle | None = None

    def add(self, *, evicted: int = 0, refused: int = 0, timed_out: int = 0) -> None:
        self.evicted += evicted
        self.refused += refused
        self.timed_out += timed_out
        if self.flush_timer is not None:
            return
        loop = asyncio.get_running_loop()
        due = self.last_line_at is None or loop.time() - self.last_line_at >= self.interval_s
        if due:
            self.flush()
        else:
            self.flush_timer = loop.call_at(self.last_line_at + self.interval_s, self.flush)

    def flush(self) -> None:
        self.flush_timer = None
        self.last_line_at = asyncio.get_running_loop().time()
        level = logging.WARNING if self.evicted or self.refused else logging.INFO
        log.log(level, "connection limits since the last report: %d waiting connections closed and %d new ones "
                "refused at --max-connections %d; %d closed by --timeout-header %g s",
                self.evicted, self.refused, self.limits.max_connections, self.timed_out, self.limits.timeout_header)
        self.evicted = self.refused = self.timed_out = 0


class ConnectionRegistry:
    """The open connections of one server and, in the order they began waiting, those waiting for a request head.

    `admit` enforces the cap; each connection reports when it starts and stops waiting and when it is gone."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.report = ClosureReport(limits)
        self.open: set[LimitedH11Protocol] = set()
        self.waiting: dict[LimitedH11Protocol, None] = {}  # insertion order: longest waiting first

    def admit(self, conn: LimitedH11Protocol) -> bool:
        """Count `conn` as open. At the cap, first close the connection that has waited longest for a request
        head; when every open connection is busy with a request, count nothing and return False."""
        if len(self.open) >= self.limits.max_connections:
            if not self.waiting:
                self.report.add(refused=1)
                return False
            next(iter(self.waiting)).close_waiting()
            self.report.add(evicted=1)
        self.open.add(conn)
        return True

    def wait_started(self, conn: LimitedH11Protocol) -> None:
        self.waiting[conn] = None

    def wait_ended(self, conn: LimitedH11Protocol) -> None:
        self.waiting.pop(conn, None)

    def closed(self, conn: LimitedH11Protocol) -> None:
        self.waiting.pop(conn, None)
        self.open.discard(conn)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a `ConnectionRegistry`: admitted (or refused) when made, a header timer armed
    whenever the connection waits for a request head and cancelled when the head is complete."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, registry: ConnectionRegistry):
        super().__init__(config, server_state, app_state, _loop)
        self.registry = registry
        self.head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.registry.admit(self):
            transport.abort()
            return
        self._track_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        self.registry.closed(self)
        super().connection_lost(exc)

    def close_waiting(self) -> None:
        """Close this connection, which is waiting for a request head, to make room at the cap. `close` (not
        abort) so that the tail of a previous response still in the write buffer reaches the client."""
        self._stop_waiting()
        self.registry.closed(self)
        self._close()

    def _track_head(self) -> None:
        """Arm the header timer when the connection starts waiting for a request head; cancel it once it stops
        (the head arrived, or the connection is closing)."""
        waiting = (not self.transport.is_closing() and self.conn.our_state is h11.IDLE
                   and self.conn.their_state is h11.IDLE)
        if waiting and self.head_timer is None:
            self.head_timer = self.loop.call_later(self.registry.limits.timeout_header, self._head_timed_out)
            self.registry.wait_started(self)
        elif not waiting:
            self._stop_waiting()

    def _stop_waiting(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        self.registry.wait_ended(self)

    def _head_timed_out(self) -> None:
        self.head_timer = None
        self.registry.wait_ended(self)
        if self.transport.is_closing():  # closed by uvicorn (keep-alive timeout, shutdown) while still flushing
            return
        self.registry.report.add(timed_out=1)
        partial_head, _ = self.conn.trailing_data
        if partial_head:
            self._send_408()
        self._close()

    def _send_408(self) -> None:
        limit = self.registry.limits.timeout_header
        body = json.dumps(error_body(f"no complete request head within {limit:g} s (--timeout-header)",
                                     "RequestTimeoutError", None, 408)).encode()
        headers = [*self.server_state.default_headers, (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=408, headers=headers,
                                                         reason=b"Request Timeout")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (or `UNLIMITED_NOFILE_TARGET` when that is unlimited);
    return the soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_NOFILE_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def fit_to_open_files(max_connections: int, open_files: int) -> tuple[int, int]:
    """(connections cap, listen backlog) that fit in `open_files` descriptors.

    asyncio accepts up to `backlog` sockets at each wake-up of the listener, but a socket is counted against the cap
    only two loop turns later (its transport is built in a task, then `connection_made` is scheduled), and the
    connection it displaces frees its descriptor a turn after that. Under a flood, up to ACCEPT_BURSTS bursts are
    open beyond the cap, so cap + ACCEPT_BURSTS * backlog + FD_RESERVE <= open_files, with the cap taking at most a
    third of the room and the backlog (never above uvicorn's default) the rest."""
    room = open_files - FD_RESERVE
    cap = min(max_connections, room // 3)
    backlog = min(DEFAULT_BACKLOG, (room - cap) // ACCEPT_BURSTS)
    if cap < 1 or backlog < 1:
        raise ConnectionLimitError(f"the open-file limit ({open_files}) leaves no room for client connections: "
                                   f"{FD_RESERVE} descriptors are kept for the server itself")
    return cap, backlog


def connection_options(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for `uvicorn.run` / `uvicorn.Config` that apply --timeout-header, --timeout-keep-alive
    and --max-connections: the limited h11 protocol (bound to a fresh registry for this server), the keep-alive
    timeout, the listen backlog, no WebSocket protocol (the API has no WebSocket routes, and an upgraded
    connection would leave the registry), and asyncio's own event loop. Raises the process's open-file limit first
    and fits the cap under it."""
    open_files = raise_open_file_limit()
    cap, backlog = fit_to_open_files(args.max_connections, open_files)
    if cap < args.max_connections:
        log.warning("--max-connections %d lowered to %d: the open-file limit is %d", args.max_connections, cap,
                    open_files)
    limits = ConnectionLimits(args.timeout_header, args.timeout_keep_alive, cap)
    protocol = functools.partial(LimitedH11Protocol, registry=ConnectionRegistry(limits))
    # uvicorn takes uvloop whenever it is installed; the protocol's timers are built on asyncio's loop, and under
    # uvloop a partial request head after a response is closed silently instead of answered 408 at the header
    # deadline (tests/test_connections.py::test_keep_alive_idle_and_partial_next_head).
    return {"http": protocol, "ws": "none", "timeout_keep_alive": limits.timeout_keep_alive, "backlog": backlog,
            "loop": "asyncio"}
