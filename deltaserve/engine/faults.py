"""Request failures inside the engine: how one is attributed, recorded, and (for tests) injected.

* `RequestFault` carries the request a failure belongs to out of code that works on many requests (the runner's
  batch building), so the core can fail that request alone.
* `RequestFailure` is what the core reports for a failed request (its whole request id: all n completions).
* `FaultInjector` raises `InjectedFault` inside one step phase for the requests whose prompt holds a trigger token.
  It exists only when `EngineArgs.fault_injection` is set (a hidden serve flag that tests use); otherwise the engine
  holds None and checks nothing.

Spec: "PHASE:TOKEN_ID[,PHASE:TOKEN_ID...]". Phases:
  schedule    after the scheduler planned the step, for each scheduled request (attributable);
  forward     while the runner builds that request's rows of the batch, before the model runs (attributable);
  model       inside the batched model call, after every row's state was updated (not attributable: the whole
              batch fails);
  sample      inside batched sampling (the core retries row by row to find the request);
  output      while the core appends the request's token and builds its output (attributable);
  detokenize  in the OutputProcessor, while it detokenises the request's token (attributable, API side).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, DeltaserveError

PHASES = ("schedule", "forward", "model", "sample", "output", "detokenize")


class InjectedFault(DeltaserveError, RuntimeError):
    """A failure raised on purpose by the FaultInjector."""


class RequestFault(DeltaserveError, RuntimeError):
    """A failure that belongs to one request; `request_id` names it and `__cause__` is the original error."""

    def __init__(self, request_id: str, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_id = request_id


@dataclass(frozen=True)
class RequestFailure:
    """A request the engine failed: finished, its pages and slots freed; `message` is for the client."""

    request_id: str
    phase: str
    message: str


def describe(phase: str, exc: BaseException) -> str:
    """The client-facing message of a failure (the error type and text, never a traceback)."""
    cause = exc.__cause__ if isinstance(exc, RequestFault) and exc.__cause__ is not None else exc
    return f"the request failed in the engine ({phase}): {type(cause).__name__}: {cause}"


class FaultInjector:
    def __init__(self, triggers: dict[str, frozenset[int]]):
        self.triggers = triggers

    @classmethod
    def parse(cls, spec: str | None) -> FaultInjector | None:
        """None for no spec; raises ConfigError for a malformed one."""
        if spec is None:
            return None
        triggers: dict[str, set[int]] = {}
        for part in spec.split(","):
            phase, _, token = part.strip().partition(":")
            if phase not in PHASES or not token.strip().isdigit():
                raise ConfigError(f"fault_injection: {part!r} is not PHASE:TOKEN_ID with PHASE one of {list(PHASES)}")
            triggers.setdefault(phase, set()).add(int(token))
        return cls({phase: frozenset(tokens) for phase, tokens in triggers.items()})

    def check(self, phase: str, request_id: str, prompt_ids: list[int]) -> None:
        """Raise InjectedFault when `phase` is armed and the prompt holds one of its trigger tokens."""
        tokens = self.triggers.get(phase)
        if tokens and not tokens.isdisjoint(prompt_ids):
            raise InjectedFault(f"fault injected in the {phase} phase for request {request_id}")
