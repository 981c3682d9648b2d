"""The engine-core process: owns the model and runs the step loop, talking to the API process over ZeroMQ.

It drains incoming messages between steps (blocking only while idle), so requests keep arriving and aborts take
effect while others stream. A request the core rejects is answered with AddFailed; nothing is allocated for it. A
request that fails later is answered with RequestFailed, and the loop goes on.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import msgpack
import zmq

from ..engine.config import EngineArgs
from ..engine.core import EngineCore
from ..engine.sampling_params import InvalidRequestError
from .messages import (AbortRequest, AddFailed, AddRequest, Probe, ProbeResult, Ready, RequestFailed, Shutdown,
                       StepOutputs, decode, encode, image_from_dict, output_to_dict, params_from_dict)

log = logging.getLogger(__name__)
_IDLE_POLL_MS = 100


def run_engine_core(args: dict, model_path: str, in_addr: str, out_addr: str, log_level: str = "WARNING") -> None:
    """Process entry point (forked by multiprocessing's fork server). Exits when told to, or when its parent goes
    away (the fork server exits with the API process)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine-core: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when the core stops
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(out_addr)
    parent = os.getppid()
    core = None
    try:
        core = EngineCore(EngineArgs(**args), Path(model_path))
        outbox.send(encode(Ready(core.max_model_len, core.config.vocab_size, sorted(core.eos_ids), os.getpid(),
                                 core.summary(), core.stats(), core.backend.describe())))
        _loop(core, inbox, outbox, parent)
    finally:
        if core is not None:
            core.close()  # its tensor-parallel workers go with it
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()


def _loop(core: EngineCore, inbox, outbox, parent: int) -> None:
    """Until Shutdown or the parent's exit. A request never ends the loop: failures inside a step come back from
    the core as RequestFailed messages, and a message whose handling fails is logged and answered where it has a
    requester. Only EngineBrokenError (pools that no longer add up) ends it, so the API process restarts the core."""
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        timeout = 0 if core.has_unfinished_requests() else _IDLE_POLL_MS
        handled = False
        while dict(poller.poll(timeout)).get(inbox):
            msg = _decode(inbox.recv())
            if isinstance(msg, Shutdown):
                return
            if msg is not None:
                _handle_safely(core, msg, outbox)
                handled = True
            timeout = 0
        if os.getppid() != parent:
            log.warning("API process is gone; stopping")
            return
        if core.has_unfinished_requests():
            outputs = core.step()
            stats = core.stats()
            stats["kv_transfer_seconds"] = core.take_kv_transfer_times()
            outbox.send(encode(StepOutputs([output_to_dict(o) for o in outputs], stats)))
            for failure in core.take_failures():
                outbox.send(encode(RequestFailed(failure.request_id, failure.message)))
        elif handled:  # e.g. aborts left the core idle: no step will report that, so refresh the stats now
            outbox.send(encode(StepOutputs([], core.stats())))


def _decode(frame: bytes):
    try:
        return decode(frame)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        log.error("dropped a malformed message from the API process: %s", e)
        return None


def _handle_safely(core: EngineCore, msg, outbox) -> None:
    try:
        _handle(core, msg, outbox)
    except Exception as exc:  # noqa: BLE001 — one message must not end the loop
        log.error("handling %s failed", type(msg).__name__, exc_info=exc)
        if isinstance(msg, AddRequest):
            core.abort(msg.request_id, reason="error")
            outbox.send(encode(RequestFailed(msg.request_id, f"the engine could not accept the request: "
                                                             f"{type(exc).__name__}: {exc}")))
        elif isinstance(msg, Probe):
            outbox.send(encode(ProbeResult(msg.probe_id, {}, f"the probe failed: {type(exc).__name__}: {exc}")))


def _handle(core: EngineCore, msg, outbox) -> None:
    if isinstance(msg, AddRequest):
        try:
            core.add_request(msg.request_id, msg.prompt_ids, params_from_dict(msg.params), msg.cache_salt,
                             msg.client, [image_from_dict(d) for d in msg.images])
        except InvalidRequestError as e:
            outbox.send(encode(AddFailed(msg.request_id, e.field, str(e))))
        except (TypeError, ValueError) as e:
            outbox.send(encode(AddFailed(msg.request_id, "request", str(e))))
    elif isinstance(msg, AbortRequest):
        core.abort(msg.request_id, msg.index, msg.reason)
    elif isinstance(msg, Probe):
        try:
            core.check_integrity()
            err = None
        except AssertionError as e:
            err = str(e)
        extra = {"free_pages": core.pages.num_free, "total_pages": core.pages.num_blocks,
                 "free_slots": core.states.num_free, "total_slots": core.states.num_slots}
        outbox.send(encode(ProbeResult(msg.probe_id, core.stats(), err, extra)))
