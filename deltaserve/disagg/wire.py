"""Messages between prefill and decode instances (docs/disaggregation.md §3): ZeroMQ multipart frames — first a
msgpack map (the header: a `kind`, its fields, and `tensors`, the name, dtype and shape of each tensor that follows),
then each tensor's raw bytes, C-contiguous. Never pickle: decoding checks the header's types, that every dtype is
one the caches use, and that each frame holds exactly its tensor's bytes, and it refuses a header or a payload over
its caps."""

from __future__ import annotations

import math

import msgpack
import torch

from ..errors import KVTransferError

# The dtypes a cache tensor may have on the wire (model dtypes, C8 bytes, 8-bit keys, fp32 scales and state).
DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "uint8", "int8",
                                                  "float8_e4m3fn")}
MAX_HEADER_BYTES = 1 << 20


def encode_message(header: dict, tensors: dict[str, torch.Tensor] | None = None) -> list:
    """The frames of one message: `header` (msgpack-able, without a "tensors" key) and `tensors`' bytes."""
    tensors = tensors or {}
    meta = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]
    frames: list = [msgpack.packb({**header, "tensors": meta})]
    for t in tensors.values():
        flat = t.detach().contiguous().reshape(-1)
        frames.append(flat.view(torch.uint8).numpy() if flat.numel() else b"")
    return frames


def decode_message(frames: list, max_bytes: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header and tensors of a message `encode_message` wrote; KVTransferError naming what is wrong with a
    malformed one, or one whose tensors hold more than `max_bytes`."""
    if not frames or len(frames[0]) > MAX_HEADER_BYTES:
        raise KVTransferError("a transfer message has no header, or one over 1 MiB")
    try:
        header = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 — any msgpack failure is the peer's malformed frame
        raise KVTransferError(f"a transfer message's header is not msgpack: {exc}") from exc
    meta = header.get("tensors") if isinstance(header, dict) else None
    if not isinstance(meta, list) or len(meta) != len(frames) - 1:
        raise KVTransferError("a transfer message's header does not list one tensor per frame")
    tensors: dict[str, torch.Tensor] = {}
    total = 0
    for entry, frame in zip(meta, frames[1:]):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[1] in DTYPES
                and isinstance(entry[2], list) and all(isinstance(d, int) and d >= 0 for d in entry[2])):
            raise KVTransferError(f"a transfer message's tensor entry {entry!r} is malformed")
        name, dtype, shape = entry[0], DTYPES[entry[1]], entry[2]
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        total += nbytes
        if total > max_bytes:
            raise KVTransferError(f"a transfer message holds more than {max_bytes} bytes")
        if len(frame) != nbytes or name in tensors:
            raise KVTransferError(f"tensor {name!r}: frame of {len(frame)} bytes for {dtype} {shape} "
                                  f"({nbytes} bytes), or a repeated name")
        raw = torch.frombuffer(bytearray(frame), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(shape)
    del header["tensors"]
    return header, tensors
