"""EngineClient: the API process's handle on the engine-core process.

It starts the core (spawned, never forked), sends requests as token ids, and turns the core's token outputs into
RequestOutputs with the OutputProcessor (detokenisation and stop strings live here, beside the tokenizer). Each
request streams through its own asyncio queue. If the core dies, every request in flight fails at once and
`healthy` turns False; a request whose consumer goes away is aborted in the core.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import zmq
import zmq.asyncio

from ..engine.config import EngineArgs
from ..engine.core import CoreOutput
from ..engine.output_processor import OutputProcessor
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import InvalidRequestError, SamplingParams
from ..errors import DeltaserveError
from ..tokenizer import Tokenizer
from .engine_proc import run_engine_core
from .messages import (AbortRequest, AddFailed, AddRequest, Probe, ProbeResult, Ready, Shutdown, StepOutputs, decode,
                       encode, output_from_dict, params_to_dict)

log = logging.getLogger(__name__)


class EngineDeadError(DeltaserveError, RuntimeError):
    """The engine-core process stopped; requests in flight cannot complete."""


class EngineClient:
    def __init__(self, args: EngineArgs, model_path: Path, tokenizer: Tokenizer, log_level: str = "WARNING"):
        self.args, self.model_path, self.tokenizer, self.log_level = args, model_path, tokenizer, log_level
        self.healthy = False
        self.stats: dict = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._probes: dict[int, asyncio.Future] = {}
        self._probe_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._dead: asyncio.Event | None = None
        self.on_outputs = None  # optional callback(list[CoreOutput], stats) for metrics

    # ---- lifecycle ----
    async def start(self, ready_timeout: float = 300.0) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="deltaserve-")
        in_addr, out_addr = f"ipc://{self._dir.name}/in", f"ipc://{self._dir.name}/out"
        self._ctx = zmq.asyncio.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.bind(in_addr)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.bind(out_addr)
        fields = {f.name: getattr(self.args, f.name) for f in dataclasses.fields(self.args)}
        fields["model"] = str(self.model_path)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(fields, str(self.model_path), in_addr, out_addr, self.log_level),
            name="deltaserve-engine-core", daemon=True)
        self.proc.start()
        ready = await self._wait_ready(ready_timeout)
        self.max_model_len, self.vocab_size, self.eos_ids = ready.max_model_len, ready.vocab_size, set(ready.eos_ids)
        self.processor = OutputProcessor(self.tokenizer, self.eos_ids)
        self._dead = asyncio.Event()
        self.healthy = True
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def _wait_ready(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.is_alive():
                raise EngineDeadError(f"the engine-core process exited during start-up (code {self.proc.exitcode})")
            if await self._from_core.poll(200):
                msg = decode(await self._from_core.recv())
                if isinstance(msg, Ready):
                    return msg
        raise EngineDeadError("the engine-core process did not become ready in time")

    async def shutdown(self, timeout: float = 10.0) -> None:
        for t in self._tasks:
            t.cancel()
        if getattr(self, "proc", None) is not None and self.proc.is_alive():
            try:
                await self._send(Shutdown())
            except EngineDeadError:
                pass
            await asyncio.get_running_loop().run_in_executor(None, self.proc.join, timeout)
            if self.proc.is_alive():
                self.proc.kill()
        self.healthy = False
        self._ctx.destroy(linger=0)
        self._dir.cleanup()

    # ---- requests ----
    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def generate(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None, client: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs until finished. Raises InvalidRequestError (rejected by the core) or
        EngineDeadError. Leaving the iteration early (client disconnect) aborts the request in the core. `client`
        is the core scheduler's fairness key (default: the request id)."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.processor.add(request_id, prompt, prompt_ids, params)
        finished = False
        try:
            await self._to_core.send(encode(AddRequest(request_id, prompt_ids, params_to_dict(params), cache_salt,
                                                        client)))
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.processor.abort(request_id)
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
        send = asyncio.ensure_future(self._to_core.send(encode(msg)))
        dead = asyncio.ensure_future(self._dead.wait())
        try:
            await asyncio.wait({send, dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
        if not send.done():
            send.cancel()
            raise EngineDeadError("the engine-core process died")
        send.result()

    # ---- background tasks ----
    async def _receive(self) -> None:
        while True:
            msg = decode(await self._from_core.recv())
            if isinstance(msg, StepOutputs):
                self.stats = msg.stats
                outputs = [output_from_dict(o) for o in msg.outputs]
                self._dispatch(outputs)
                if self.on_outputs is not None:
                    self.on_outputs(outputs, msg.stats)
            elif isinstance(msg, AddFailed):
                q = self._queues.get(msg.request_id)
                self.processor.abort(msg.request_id)
                if q is not None:
                    q.put_nowait(InvalidRequestError(msg.field, msg.message))
            elif isinstance(msg, ProbeResult):
                fut = self._probes.get(msg.probe_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _dispatch(self, outputs: list[CoreOutput]) -> None:
        results, stops = self.processor.process(outputs)
        for request_id, index in stops:
            self._to_core.send(encode(AbortRequest(request_id, index, "stop")))
        for out in results:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    async def _watch(self) -> None:
        while self.proc.is_alive():
            await asyncio.sleep(0.2)
        self.healthy = False
        self._dead.set()
        log.error("the engine-core process died (exit code %s); failing %d requests", self.proc.exitcode,
                  len(self._queues))
        err = EngineDeadError(f"the engine-core process died (exit code {self.proc.exitcode})")
        for q in self._queues.values():
            q.put_nowait(err)
        for fut in self._probes.values():
            if not fut.done():
                fut.set_exception(err)
