"""The two halves of a transfer (docs/disaggregation.md §3–4), each with one thread that owns its ZeroMQ sockets.

`KVProducer` (a prefill instance): the engine copies a finished prefill's cache out of its pools (`stage`, on the
engine thread, which then frees the pages and slot at once) and the producer keeps it until a consumer pulls it or
`hold_timeout_s` passes. Its thread answers on a ROUTER socket at kv_ip:kv_port: `hello` (the handshake: it answers
with its cache format) and `pull` (the staged payload from the page the consumer asks for — the earlier ones it
holds already — which it then drops, or an error naming why there is none).

`KVConsumer` (a decode instance): `pull` queues a request's transfer; the thread connects to the producer (a DEALER
socket per peer, kept), does the handshake once per peer — refusing a peer whose model or cache format differs —
then pulls, and files the payload or the KVTransferError (naming the stage and the peer) for `take_done`. A stage
that gets no answer within its timeout fails, and its socket is dropped so a late answer cannot be taken for the
next one's."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter

import zmq

from ..errors import KVTransferError
from .config import KVTransferConfig
from .payload import KVPayload, check_format
from .wire import decode_message, encode_message

log = logging.getLogger(__name__)

POLL_MS = 200  # how often the producer's thread looks at its stop flag and its expiries


class KVProducer:
    def __init__(self, config: KVTransferConfig, cache_format: dict, engine_id: str):
        self.config, self.format, self.engine_id = config, cache_format, engine_id
        self._lock = threading.Lock()
        self._staged: dict[str, tuple[KVPayload, float]] = {}  # transfer id -> (payload, expiry on the monotonic clock)
        self.num_staged = self.num_sent = self.num_expired = self.bytes_sent = 0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if config.kv_port:
                self._socket.bind(f"tcp://{config.kv_ip}:{config.kv_port}")
                self.port = config.kv_port
            else:
                self.port = self._socket.bind_to_random_port(f"tcp://{config.kv_ip}")
        except zmq.ZMQError as exc:
            self._socket.close()
            self._context.term()
            raise KVTransferError(f"kv_transfer_config: cannot listen on {config.kv_ip}:{config.kv_port}: {exc}",
                                  "handshake") from exc
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-producer", daemon=True)
        self._thread.start()
        log.info("kv producer %s listens on %s:%d", engine_id, config.kv_ip, self.port)

    def stage(self, transfer_id: str, payload: KVPayload) -> dict:
        """Keep `payload` for a consumer; the kv_transfer_params a decode instance's request carries to pull it."""
        with self._lock:
            self._staged[transfer_id] = (payload, time.monotonic() + self.config.hold_timeout_s)
            self.num_staged += 1
        return {"do_remote_prefill": True, "remote_engine_id": self.engine_id, "remote_host": self.config.kv_ip,
                "remote_port": self.port, "transfer_id": transfer_id, "num_tokens": payload.num_tokens}

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._staged)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._context.term()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(POLL_MS):
                    identity, *frames = self._socket.recv_multipart(copy=False)
                    self._socket.send_multipart([identity, *self._answer([f.buffer for f in frames])])
                self._expire()
        finally:
            self._socket.close()

    def _answer(self, frames: list) -> list:
        try:
            header, _ = decode_message(frames, max_bytes=0)
        except KVTransferError as exc:
            return encode_message({"kind": "error", "message": str(exc)})
        kind = header.get("kind")
        if kind == "hello":
            return encode_message({"kind": "hello", "format": self.format, "engine_id": self.engine_id})
        if kind != "pull":
            return encode_message({"kind": "error", "message": f"unknown message kind {kind!r}"})
        transfer_id = header.get("transfer_id")
        with self._lock:
            entry = self._staged.pop(transfer_id, None) if isinstance(transfer_id, str) else None
        if entry is None:
            return encode_message({"kind": "error", "transfer_id": transfer_id,
                                   "message": f"transfer {transfer_id!r} is not held here (never staged, already "
                                              f"pulled, or expired after {self.config.hold_timeout_s:g} s)"})
        try:
            payload = entry[0].from_page(header.get("from_page", 0))
        except (KVTransferError, TypeError) as exc:
            return encode_message({"kind": "error", "transfer_id": transfer_id, "message": f"pull: {exc}"})
        self.num_sent += 1
        self.bytes_sent += payload.nbytes
        return encode_message({"kind": "payload", "transfer_id": transfer_id, "num_tokens": payload.num_tokens,
                               "tokens": payload.tokens, "first_page": payload.first_page}, payload.tensors)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [tid for tid, (_, expiry) in self._staged.items() if expiry < now]
            for tid in gone:
                del self._staged[tid]
            self.num_expired += len(gone)
        for tid in gone:
            log.warning("kv transfer %s expired: no consumer pulled it within %g s", tid, self.config.hold_timeout_s)


class KVConsumer:
    def __init__(self, config: KVTransferConfig, cache_format: dict):
        self.config, self.format = config, cache_format
        self._jobs: queue.Queue = queue.Queue()
        self._done: list[tuple[str, KVPayload | KVTransferError, float]] = []
        self._ready = threading.Condition()
        self.num_received = self.bytes_received = 0
        self.seconds = 0.0
        self._failures: Counter = Counter()  # by stage; under `_ready`'s lock (two threads count)
        self._thread = threading.Thread(target=self._work, name="kv-consumer", daemon=True)
        self._thread.start()

    def pull(self, request_id: str, params: dict, first_page: int = 0) -> None:
        """Queue the transfer `params` (a producer's kv_transfer_params) names for request `request_id`, from its
        page `first_page` on (this side holds the earlier ones)."""
        self._jobs.put((request_id, params, first_page))

    def take_done(self) -> list[tuple[str, KVPayload | KVTransferError, float]]:
        """The transfers finished since the last call: (request id, payload or error, seconds it took)."""
        with self._ready:
            done, self._done = self._done, []
        return done

    def count_failure(self, stage: str) -> None:
        with self._ready:
            self._failures[stage] += 1

    def failures(self) -> dict[str, int]:
        """Failed transfers so far, by stage."""
        with self._ready:
            return dict(self._failures)

    def wait(self, timeout: float) -> None:
        """Until a transfer finishes, at most `timeout` seconds."""
        with self._ready:
            if not self._done:
                self._ready.wait(timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _work(self) -> None:
        context = zmq.Context()
        peers: dict[tuple[str, int], zmq.Socket] = {}
        try:
            while (job := self._jobs.get()) is not None:
                request_id, params, first_page = job
                started = time.perf_counter()
                try:
                    result: KVPayload | KVTransferError = self._pull(context, peers, params, first_page)
                    self.num_received += 1
                    self.bytes_received += result.nbytes
                except KVTransferError as exc:
                    result = exc
                except Exception as exc:  # noqa: BLE001 — this thread must outlive any one transfer
                    result = KVTransferError(f"transfer failed: {type(exc).__name__}: {exc}")
                if isinstance(result, KVTransferError):
                    self.count_failure(result.stage)
                seconds = time.perf_counter() - started
                self.seconds += seconds
                with self._ready:
                    self._done.append((request_id, result, seconds))
                    self._ready.notify_all()
        finally:
            for sock in peers.values():
                sock.close(linger=0)
            context.term()

    def _pull(self, context: zmq.Context, peers: dict, params: dict, first_page: int) -> KVPayload:
        address = (params["remote_host"], params["remote_port"])
        sock = peers.get(address)
        if sock is None:
            sock = context.socket(zmq.DEALER)
            sock.connect(f"tcp://{address[0]}:{address[1]}")
            peers[address] = sock
            sock.send_multipart(encode_message({"kind": "hello"}))
            header, _ = self._receive(peers, address, self.config.handshake_timeout_s, "handshake", 0)
            if header.get("kind") != "hello":
                self._drop(peers, address)
                raise KVTransferError(f"the prefill instance at {address[0]}:{address[1]} answered the handshake "
                                      f"with {header.get('message', header.get('kind'))!r}", "handshake")
            try:
                check_format(self.format, header.get("format") or {})
            except KVTransferError as exc:
                self._drop(peers, address)
                raise KVTransferError(f"the prefill instance at {address[0]}:{address[1]}: {exc}", "handshake")
        transfer_id = params["transfer_id"]
        sock.send_multipart(encode_message({"kind": "pull", "transfer_id": transfer_id, "from_page": first_page}))
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while True:  # answers to an earlier, abandoned pull are skipped
            header, tensors = self._receive(peers, address, max(deadline - time.monotonic(), 0), "transfer",
                                            self.config.max_transfer_bytes)
            if header.get("transfer_id") == transfer_id:
                break
        if header.get("kind") != "payload":
            raise KVTransferError(f"the prefill instance at {address[0]}:{address[1]}: {header.get('message')}")
        return KVPayload(int(header["num_tokens"]), tensors, str(header.get("tokens")), int(header["first_page"]))

    def _receive(self, peers: dict, address: tuple[str, int], timeout: float, stage: str,
                 max_bytes: int) -> tuple[dict, dict]:
        sock = peers[address]
        if not sock.poll(int(timeout * 1000)):
            self._drop(peers, address)
            raise KVTransferError(f"{stage}: the prefill instance at {address[0]}:{address[1]} did not answer "
                                  f"within {timeout:g} s", stage)
        try:
            return decode_message(sock.recv_multipart(), max_bytes)
        except KVTransferError as exc:
            self._drop(peers, address)
            raise KVTransferError(f"{stage}: from {address[0]}:{address[1]}: {exc}", stage) from exc

    @staticmethod
    def _drop(peers: dict, address: tuple[str, int]) -> None:
        peers.pop(address).close(linger=0)
