"""SamplingParams: the per-request generation settings, with vLLM's names and defaults.

Every value is validated in `__post_init__` (and again by `validate()`, which callers run before queueing a
request whose params may have been mutated since); a bad one raises `InvalidRequestError`, whose message
names the field and whose `.field` attribute holds that name, so an API server can map the error
to a 400 response that points at the offending parameter.

Besides each field's own range, the values must be representable on the way to the engine
(`representable`): counts fit an int64, floats are finite, stop strings are valid UTF-8, and the
per-sample seeds `seed + i` (i < n) stay inside what msgpack and torch's `Generator.manual_seed` accept.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import DeltaserveError
from .representable import COUNT_MAX, INT_MAX, INT_MIN, is_utf8

# vLLM's default max_logprobs: asking for more alternatives than this is a request error.
MAX_LOGPROBS = 20


class InvalidRequestError(DeltaserveError, ValueError):
    """A request parameter is out of range or of the wrong type.

    `field` is the parameter's name (e.g. "temperature"); the message always contains it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but `max_tokens=True` is a caller bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: Any, low: int = 0) -> bool:
    """An int in [low, COUNT_MAX]: what an int64 tensor holds."""
    return _is_int(value) and low <= value <= COUNT_MAX


def _is_real(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(name, message)


@dataclass
class StructuredOutputsParams:
    """A constraint on the whole output (vLLM's `structured_outputs`), enforced by token masks in the sampler
    (engine/grammar.py). Exactly one of: `json`, a JSON schema (an object, or its JSON text); `regex`; `choice`, the
    output is one of these strings; `grammar`, a Lark grammar in llguidance's dialect (special tokens as `<|name|>`)
    or an llguidance JSON grammar (`{"grammars": [...]}`); `json_object`, any JSON object.
    Whether the engine can compile it is checked when the request is added (InvalidRequestError naming
    `structured_outputs`)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def validate(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        _require(isinstance(self.json_object, bool), "structured_outputs.json_object",
                 f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if self.json_object:
            given.append("json_object")
        _require(len(given) == 1, "structured_outputs",
                 f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; got {given}")
        _require(self.json is None or isinstance(self.json, (dict, str)), "structured_outputs.json",
                 "structured_outputs.json must be a JSON schema (an object or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, str) and value != "" and is_utf8(value)),
                     f"structured_outputs.{name}", f"structured_outputs.{name} must be a non-empty UTF-8 string")
        if self.choice is not None:
            _require(isinstance(self.choice, list) and len(self.choice) > 0
                     and all(isinstance(c, str) and c != "" and is_utf8(c) for c in self.choice),
                     "structured_outputs.choice", "structured_outputs.choice must be a non-empty list of non-empty "
                                                  "strings")


@dataclass
class SamplingParams:
    """Settings for generating one request's completion(s).

    Defaults match vLLM. `top_k` of 0 or -1 disables top-k (stored as 0); `max_tokens=None` means
    "until max_model_len", which the engine resolves; `stop` may be given as a single string and
    is stored as a list; `logprobs=N` reports the sampled token's logprob plus the top N
    alternatives (0 = only the sampled token, None = no logprobs); `prompt_logprobs=N` reports the same for every
    prompt token after the first, from the logits of the tokens before it (vLLM's extension; the prefix cache is
    not read for such a request, since a cached token has no logits).

    Raises `InvalidRequestError` (with `.field`) on construction when a value is invalid.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # Prefill/decode disaggregation (docs/disaggregation.md), vLLM's keys: {"do_remote_decode": true} on a prefill
    # instance; on a decode instance the kv_transfer_params the prefill instance returned ({"do_remote_prefill":
    # true, "remote_host", "remote_port", "transfer_id", "num_tokens", ...}). Other keys are ignored.
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        self._normalise()
        self.validate()

    def _normalise(self) -> None:
        # Accept the spellings vLLM accepts: a bare stop string, None lists, and top_k=-1 for "off".
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            _require(isinstance(self.stop, (list, tuple)), "stop",
                     f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            _require(isinstance(self.stop_token_ids, (list, tuple, set)), "stop_token_ids",
                     f"stop_token_ids must be a list of ints, got {type(self.stop_token_ids).__name__}")
            self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):  # as it travels in messages and as vLLM accepts it
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise InvalidRequestError("structured_outputs", f"structured_outputs: {exc}") from None

    def validate(self) -> None:
        """Check every field (type, range, representability); raises InvalidRequestError naming the field."""
        # Checks are written so that NaN and infinities fail too (`_is_real` requires a finite number).
        _require(_is_count(self.n, 1), "n", f"n must be an int in [1, {COUNT_MAX}], got {self.n!r}")
        _require(_is_real(self.temperature) and self.temperature >= 0, "temperature",
                 f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _require(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p",
                 f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(_is_count(self.top_k), "top_k",
                 f"top_k must be an int in [-1, {COUNT_MAX}] (0 or -1 disables it), got {self.top_k!r}")
        _require(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p",
                 f"min_p must be in [0, 1], got {self.min_p!r}")
        self._validate_seed()
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_real(value) and -2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value!r}")
        _require(_is_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        _require(self.max_tokens is None or _is_count(self.max_tokens, 1), "max_tokens",
                 f"max_tokens must be an int in [1, {COUNT_MAX}] or None, got {self.max_tokens!r}")
        _require(_is_count(self.min_tokens), "min_tokens",
                 f"min_tokens must be an int in [0, {COUNT_MAX}], got {self.min_tokens!r}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for i, stop in enumerate(self.stop):
            _require(isinstance(stop, str), "stop", f"stop entries must be strings, got {stop!r}")
            _require(stop != "", "stop", "stop must not contain an empty string")
            _require(is_utf8(stop), "stop", f"stop entry {i} is not valid UTF-8 (it holds a lone surrogate)")
        for tid in self.stop_token_ids:
            _require(_is_count(tid), "stop_token_ids",
                     f"stop_token_ids must be ints in [0, {COUNT_MAX}], got {tid!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                     f"{name} must be an int in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        if self.structured_outputs is not None:
            _require(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                     "structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _require(isinstance(getattr(self, name), bool), name, f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.kv_transfer_params is not None:
            self._validate_kv_transfer()

    def _validate_kv_transfer(self) -> None:
        kv = self.kv_transfer_params
        _require(isinstance(kv, dict), "kv_transfer_params", f"kv_transfer_params must be an object, got {kv!r}")
        for key in ("do_remote_decode", "do_remote_prefill"):
            _require(isinstance(kv.get(key, False), bool), "kv_transfer_params",
                     f"kv_transfer_params.{key} must be a bool, got {kv.get(key)!r}")
        _require(not (kv.get("do_remote_decode") and kv.get("do_remote_prefill")), "kv_transfer_params",
                 "kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other")
        if kv.get("do_remote_prefill") and kv.get("num_tokens", 0) != 0:
            for key, ok in (("remote_host", lambda v: isinstance(v, str) and v != ""),
                            ("remote_port", lambda v: _is_int(v) and 0 < v < 65536),
                            ("transfer_id", lambda v: isinstance(v, str) and v != ""),
                            ("num_tokens", lambda v: _is_count(v))):
                _require(ok(kv.get(key)), "kv_transfer_params",
                         f"kv_transfer_params.{key} is missing or invalid ({kv.get(key)!r}): pass on the "
                         f"kv_transfer_params the prefill instance returned")

    def _validate_seed(self) -> None:
        # The engine seeds sample i of n with `seed + i`; every one of those must reach torch's manual_seed.
        if self.seed is None:
            return
        _require(_is_int(self.seed) and INT_MIN <= self.seed <= INT_MAX, "seed",
                 f"seed must be an int in [{INT_MIN}, {INT_MAX}] or None, got {self.seed!r}")
        last = INT_MAX - (self.n - 1)
        _require(self.seed <= last, "seed",
                 f"seed {self.seed} with n={self.n} overflows: sample i is seeded with seed + i, so seed must be "
                 f"<= {last}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature 0, or top_k 1."""
        return self.temperature == 0 or self.top_k == 1

    def clone(self) -> SamplingParams:
        """A deep copy: mutating the clone's lists never affects this object."""
        return copy.deepcopy(self)
