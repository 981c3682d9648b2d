"""EngineClient: the API process's handle on the engine-core process.

It starts the core through multiprocessing's fork server (never a fork of this multi-threaded process: the fork
server is a clean single-threaded interpreter that imported the engine modules once, so a restart skips the import
of torch and costs little more than loading the model), sends requests as token ids, and turns the core's token
outputs into
RequestOutputs with the OutputProcessor (detokenisation and stop strings live here, beside the tokenizer). Each
request streams through its own asyncio queue; a request whose consumer goes away is aborted in the core.

Failures:
* a request the core fails (RequestFailed) or whose text fails here raises RequestFailedError in its stream only;
* if the core process dies, every request in flight fails at once with EngineDeadError, `healthy` turns False, and
  a fresh core is started on fresh sockets (nothing queued for or sent by the dead one reaches its successor).
  At most `max_restarts` restarts are allowed within any `restart_window_s` seconds; past that `fatal` is set and
  `on_fatal` is called, so the API process exits and its supervisor restarts the whole server;
* `fail_in_flight(exc)` ends every request in flight with `exc` (the SIGTERM drain deadline).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import zmq
import zmq.asyncio

from ..engine.config import EngineArgs
from ..engine.core import CoreOutput
from ..engine.faults import FaultInjector
from ..engine.output_processor import OutputProcessor
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import InvalidRequestError, SamplingParams
from ..engine.summary import EngineSummary
from ..errors import DeltaserveError, RequestFailedError
from ..tokenizer import Tokenizer
from .engine_proc import run_engine_core
from .messages import (AbortRequest, AddFailed, AddRequest, Probe, ProbeResult, Ready, RequestFailed, Shutdown,
                       StepOutputs, decode, encode, image_to_dict, output_from_dict, params_to_dict)

log = logging.getLogger(__name__)
_WATCH_INTERVAL_S = 0.1
_STILL_WAITING_S = 30.0  # a start-up that takes longer (a first build of the native kernels) says it is alive


class EngineDeadError(DeltaserveError, RuntimeError):
    """The engine-core process is not running (died, restarting, or stopped); requests in flight cannot complete."""


class ServerDrainTimeoutError(EngineDeadError):
    """The server is shutting down and the request did not finish within the drain time (--shutdown-timeout)."""


class EngineClient:
    def __init__(self, args: EngineArgs, model_path: Path, tokenizer: Tokenizer, log_level: str = "WARNING",
                 max_restarts: int = 3, restart_window_s: float = 600.0):
        self.args, self.model_path, self.tokenizer, self.log_level = args, model_path, tokenizer, log_level
        self.max_restarts, self.restart_window_s = max_restarts, restart_window_s
        self.healthy = False
        self.fatal = False  # the core died and may not be restarted again: the API process should exit
        self.num_restarts = 0
        self.stats: dict = {}
        self.summary: EngineSummary | None = None  # from the core's Ready: what it loaded, for the banner
        self._queues: dict[str, asyncio.Queue] = {}
        self._probes: dict[int, asyncio.Future] = {}
        self._probe_ids = itertools.count()
        self._restart_times: deque[float] = deque()
        self._generation = 0
        self._closing = False
        self._receiver: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._dead: asyncio.Event | None = None
        self.proc = None
        self.on_outputs: Callable[[list[CoreOutput], dict], None] | None = None  # metrics: (outputs, stats)
        self.on_restart: Callable[[], None] | None = None  # metrics: one call per restart
        self.on_fatal: Callable[[], None] | None = None  # restarts exhausted

    # ---- lifecycle ----
    async def start(self, ready_timeout: float = 300.0) -> None:
        self.ready_timeout = ready_timeout
        self._dir = tempfile.TemporaryDirectory(prefix="deltaserve-")
        self._ctx = zmq.asyncio.Context()
        self._mp = multiprocessing.get_context("forkserver")
        self._mp.set_forkserver_preload([run_engine_core.__module__])
        await self._spawn()
        self._watcher = asyncio.create_task(self._watch())

    async def _spawn(self) -> None:
        """Start a core on sockets of its own and wait until it is ready. Raises EngineDeadError."""
        self._generation += 1
        base = f"ipc://{self._dir.name}/{self._generation}"
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.bind(base + "-in")
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.bind(base + "-out")
        fields = {f.name: getattr(self.args, f.name) for f in dataclasses.fields(self.args)}
        fields["model"] = str(self.model_path)
        self.proc = self._mp.Process(
            target=run_engine_core, args=(fields, str(self.model_path), base + "-in", base + "-out", self.log_level),
            name="deltaserve-engine-core", daemon=True)
        log.info("starting the engine-core process for %s", self.model_path)
        self.proc.start()
        ready = await self._wait_ready(self.ready_timeout)
        self.max_model_len, self.vocab_size, self.eos_ids = ready.max_model_len, ready.vocab_size, set(ready.eos_ids)
        self.backend, self.summary = ready.backend, ready.summary
        self.processor = OutputProcessor(self.tokenizer, self.eos_ids, FaultInjector.parse(self.args.fault_injection))
        self._observe([], ready.stats)
        self._dead = asyncio.Event()
        self._receiver = asyncio.create_task(self._receive(self._from_core))
        self.healthy = True

    async def _wait_ready(self, timeout: float) -> Ready:
        started = time.monotonic()
        deadline, next_note = started + timeout, started + _STILL_WAITING_S
        while time.monotonic() < deadline:
            if not self.proc.is_alive():
                raise EngineDeadError(f"the engine-core process exited during start-up (code {self.proc.exitcode})")
            if await self._from_core.poll(200):
                msg = decode(await self._from_core.recv())
                if isinstance(msg, Ready):
                    return msg
            if time.monotonic() >= next_note:
                log.info("still waiting for the engine core to be ready (%.0f s)", time.monotonic() - started)
                next_note += _STILL_WAITING_S
        self.proc.kill()
        raise EngineDeadError("the engine-core process did not become ready in time")

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        for task in (self._watcher, self._receiver):
            if task is not None:
                task.cancel()
        if self.proc is not None and self.proc.is_alive():
            try:
                await self._send(Shutdown())
                await asyncio.get_running_loop().run_in_executor(None, self.proc.join, timeout)
            except EngineDeadError:
                pass  # not serving (e.g. mid-restart): nothing to drain there
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout)
        self.healthy = False
        self._ctx.destroy(linger=0)
        self._dir.cleanup()

    def fail_in_flight(self, exc: BaseException) -> int:
        """End every request in flight with `exc` (each stream raises it; its abort reaches the core). Returns how
        many were failed."""
        for q in self._queues.values():
            q.put_nowait(exc)
        return len(self._queues)

    # ---- requests ----
    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def generate(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None, client: str | None = None,
                       images: list | None = None) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs until finished. Raises InvalidRequestError (rejected by the core),
        RequestFailedError (failed in the engine) or EngineDeadError. Leaving the iteration early (client
        disconnect) aborts the request in the core. `client` is the core scheduler's fairness key (default: the
        request id)."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        processor = self.processor
        processor.add(request_id, prompt, prompt_ids, params)
        finished = False
        try:
            await self._send(AddRequest(request_id, prompt_ids, params_to_dict(params), cache_salt, client,
                                        [image_to_dict(i) for i in images or []]))
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                processor.abort(request_id)
                if self.healthy:
                    try:
                        await self._send(AbortRequest(request_id))
                    except EngineDeadError:
                        pass

    async def probe(self, timeout: float = 10.0) -> ProbeResult:
        """Stats and a pool integrity check from the core."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        pid = next(self._probe_ids)
        fut = asyncio.get_running_loop().create_future()
        self._probes[pid] = fut
        try:
            await self._send(Probe(pid))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._probes.pop(pid, None)

    async def _send(self, msg) -> None:
        """Send to the core, failing with EngineDeadError instead of blocking forever once the core is gone (a PUSH
        socket whose only peer died blocks on send)."""
        if not self.healthy or self._dead is None or self._dead.is_set():
            raise EngineDeadError("the engine is not running")
        dead_event = self._dead
        send = asyncio.ensure_future(self._to_core.send(encode(msg)))
        dead = asyncio.ensure_future(dead_event.wait())
        try:
            await asyncio.wait({send, dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
        if not send.done():
            send.cancel()
            raise EngineDeadError("the engine-core process died")
        send.result()

    # ---- background tasks ----
    async def _receive(self, sock) -> None:
        while True:
            frame = await sock.recv()
            try:
                self._on_message(decode(frame))
            except Exception as exc:  # noqa: BLE001 — one bad message must not stop every stream
                log.error("could not handle a message from the engine core", exc_info=exc)

    def _on_message(self, msg) -> None:
        if isinstance(msg, StepOutputs):
            outputs = [output_from_dict(o) for o in msg.outputs]
            self._dispatch(outputs)
            self._observe(outputs, msg.stats)
        elif isinstance(msg, RequestFailed):
            self._fail_request(msg.request_id, RequestFailedError(msg.message))
        elif isinstance(msg, AddFailed):
            self._fail_request(msg.request_id, InvalidRequestError(msg.field, msg.message))
        elif isinstance(msg, ProbeResult):
            fut = self._probes.get(msg.probe_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _observe(self, outputs: list[CoreOutput], stats: dict) -> None:
        self.stats = stats
        if self.on_outputs is not None:
            self.on_outputs(outputs, stats)

    def _fail_request(self, request_id: str, exc: BaseException) -> None:
        self.processor.abort(request_id)
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(exc)

    def _dispatch(self, outputs: list[CoreOutput]) -> None:
        results, stops, failures = self.processor.process(outputs)
        for request_id, index in stops:
            self._to_core.send(encode(AbortRequest(request_id, index, "stop")))
        for request_id, message in failures.items():
            self._to_core.send(encode(AbortRequest(request_id, None, "error")))
            self._fail_request(request_id, RequestFailedError(message))
        for out in results:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    async def _watch(self) -> None:
        """Notice the core's death, fail what was in flight, and restart it while the restart budget allows."""
        while True:
            while self.proc.is_alive():
                await asyncio.sleep(_WATCH_INTERVAL_S)
            if self._closing:
                return
            self._on_death()
            while True:
                if not self._may_restart():
                    log.critical("the engine-core process died and %d restarts within %.0f s are used up; "
                                 "the server stops", self.max_restarts, self.restart_window_s)
                    self.fatal = True
                    if self.on_fatal is not None:
                        self.on_fatal()
                    return
                self.num_restarts += 1
                log.warning("restarting the engine-core process (restart %d)", self.num_restarts)
                if self.on_restart is not None:
                    self.on_restart()
                try:
                    await self._spawn()
                    log.warning("the engine-core process is back (pid %d)", self.proc.pid)
                    break
                except EngineDeadError as e:
                    log.error("the engine-core restart failed: %s", e)
                    self._close_sockets()

    def _on_death(self) -> None:
        self.healthy = False
        self._dead.set()
        log.error("the engine-core process died (exit code %s); failing %d requests", self.proc.exitcode,
                  len(self._queues))
        err = EngineDeadError(f"the engine-core process died (exit code {self.proc.exitcode}); it is restarting")
        self.fail_in_flight(err)
        for fut in self._probes.values():
            if not fut.done():
                fut.set_exception(err)
        self._receiver.cancel()
        self._close_sockets()
        self._observe([], {**self.stats, "num_running": 0, "num_waiting": 0})

    def _close_sockets(self) -> None:
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)

    def _may_restart(self) -> bool:
        """At most max_restarts restarts within any restart_window_s seconds."""
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > self.restart_window_s:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.max_restarts:
            return False
        self._restart_times.append(now)
        return True
