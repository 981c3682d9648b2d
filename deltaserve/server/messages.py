"""Typed messages between the API process and the engine-core process, as msgpack maps (never pickle).

API -> core: AddRequest, AbortRequest, Shutdown, Probe.
core -> API: Ready, StepOutputs, AddFailed, RequestFailed, ProbeResult.
Every message is a dataclass; `encode` writes {"kind": <class name>, **fields}, `decode` checks the kind and the
field names before building the dataclass back, so a malformed frame is rejected rather than half-read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgpack
import torch

from ..engine.core import CoreOutput
from ..engine.sampler import TokenLogprobs
from ..engine.sampling_params import SamplingParams
from ..engine.summary import EngineSummary
from ..vision import ProcessedImage


@dataclass
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: dict  # SamplingParams fields
    cache_salt: str | None = None
    client: str | None = None  # the scheduler's fairness key; None: the request id
    images: list = field(default_factory=list)  # processed images (`image_to_dict`), the API process's work


@dataclass
class AbortRequest:
    request_id: str
    index: int | None = None
    reason: str = "abort"


@dataclass
class Shutdown:
    pass


@dataclass
class Probe:
    """Ask the core for its stats and a pool integrity check (debug endpoint, tests)."""

    probe_id: int


@dataclass
class Ready:
    """The core loaded its model and sized its pools; `summary` is what the start-up banner shows (a map of exactly
    EngineSummary's fields on the wire, rebuilt into one on decode)."""

    max_model_len: int
    vocab_size: int
    eos_ids: list[int]
    pid: int
    summary: EngineSummary
    stats: dict = field(default_factory=dict)  # the fresh core's stats (all idle)
    backend: dict = field(default_factory=dict)  # the execution backend, why it was chosen, its op set

    def __post_init__(self) -> None:
        if isinstance(self.summary, dict):
            self.summary = _build(EngineSummary, self.summary)


@dataclass
class StepOutputs:
    """The tokens of one step with the stats after it; with no outputs, a stats refresh (e.g. after aborts left the
    core idle, so the gauges do not keep the last busy step's values)."""

    outputs: list[dict]  # CoreOutput fields
    stats: dict


@dataclass
class RequestFailed:
    """The core failed a request it had accepted (engine/faults.py); it is finished and freed there."""

    request_id: str
    message: str


@dataclass
class AddFailed:
    request_id: str
    field: str
    message: str


@dataclass
class ProbeResult:
    probe_id: int
    stats: dict
    integrity_error: str | None = None
    extra: dict = field(default_factory=dict)


MESSAGES = {cls.__name__: cls for cls in (AddRequest, AbortRequest, Shutdown, Probe, Ready, StepOutputs, AddFailed,
                                          RequestFailed, ProbeResult)}


def encode(msg) -> bytes:
    return msgpack.packb({"kind": type(msg).__name__, **dataclasses.asdict(msg)}, use_bin_type=True)


def decode(frame: bytes):
    data = msgpack.unpackb(frame, raw=False)
    if not isinstance(data, dict) or data.get("kind") not in MESSAGES:
        raise ValueError("malformed engine message")
    return _build(MESSAGES[data.pop("kind")], data)


def _build(cls, data: dict):
    """`cls(**data)` once the names are checked: an unexpected field is a ValueError, a missing one a TypeError."""
    if not isinstance(data, dict):
        raise ValueError(f"malformed {cls.__name__}: {type(data).__name__} instead of a map")
    names = {f.name for f in dataclasses.fields(cls)}
    if set(data) - names:
        raise ValueError(f"unexpected fields in {cls.__name__}: {sorted(set(data) - names)}")
    return cls(**data)


def image_to_dict(image: ProcessedImage) -> dict:
    """A processed image on the wire: its fp32 patches as raw bytes with their shape, and its metadata."""
    return {"pixels": image.pixel_values.float().contiguous().numpy().tobytes(),
            "shape": list(image.pixel_values.shape), "grid": list(image.grid), "num_tokens": image.num_tokens,
            "size": list(image.size), "digest": image.digest}


def image_from_dict(d: dict) -> ProcessedImage:
    """The image `image_to_dict` wrote; ValueError when its bytes do not fill its shape."""
    shape = [int(v) for v in d["shape"]]
    if len(shape) != 4 or 4 * shape[0] * shape[1] * shape[2] * shape[3] != len(d["pixels"]):
        raise ValueError(f"an image of shape {shape} does not match its {len(d['pixels'])} bytes")
    pixels = torch.frombuffer(bytearray(d["pixels"]), dtype=torch.float32).reshape(shape)
    return ProcessedImage(pixels, tuple(int(v) for v in d["grid"]), int(d["num_tokens"]),
                          tuple(int(v) for v in d["size"]), str(d["digest"]))


def params_to_dict(p: SamplingParams) -> dict:
    return dataclasses.asdict(p)


def params_from_dict(d: dict) -> SamplingParams:
    return SamplingParams(**d)


def _logprob_to_list(lp: TokenLogprobs | None) -> list | None:
    return None if lp is None else [lp.token_id, lp.logprob, lp.rank, [list(t) for t in lp.top]]


def _logprob_from_list(lp: list | None) -> TokenLogprobs | None:
    return None if lp is None else TokenLogprobs(lp[0], lp[1], lp[2], [tuple(t) for t in lp[3]])


def output_to_dict(o: CoreOutput) -> dict:
    # the fields one level deep: asdict would first deep-copy the logprob reports that are rewritten here anyway
    d = {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
    d["logprob"] = _logprob_to_list(o.logprob)
    if o.prompt_logprobs is not None:
        d["prompt_logprobs"] = [_logprob_to_list(lp) for lp in o.prompt_logprobs]
    return d


def output_from_dict(d: dict) -> CoreOutput:
    d = {**d, "logprob": _logprob_from_list(d.get("logprob"))}
    if d.get("prompt_logprobs") is not None:
        d["prompt_logprobs"] = [_logprob_from_list(lp) for lp in d["prompt_logprobs"]]
    return CoreOutput(**d)
