"""Typed errors raised by deltaserve. Each names the thing that is wrong so a user can fix it."""


class DeltaserveError(Exception):
    """Base class of every error deltaserve raises on purpose."""


class ConfigError(DeltaserveError, ValueError):
    """A checkpoint's config.json is missing a key, has an invalid value, or contradicts itself."""


class CheckpointError(DeltaserveError, ValueError):
    """A checkpoint's tensors do not match what its config describes (missing, unexpected, mis-shaped)."""


class RequestFailedError(DeltaserveError, RuntimeError):
    """The engine failed a request (an error inside a step that belongs to it); other requests are unaffected.
    Offline, `outputs` holds every output of the batch, the failed ones with `error` set."""

    def __init__(self, message: str, outputs: list | None = None):
        super().__init__(message)
        self.outputs = outputs or []


class KVTransferError(DeltaserveError, RuntimeError):
    """A prefill/decode transfer of a request's cache could not be done: the peers disagree on the model or the cache
    format, a message is malformed, or a stage timed out (docs/disaggregation.md). `stage`: "handshake",
    "transfer" or "load", for the failure counters."""

    def __init__(self, message: str, stage: str = "transfer"):
        super().__init__(message)
        self.stage = stage
