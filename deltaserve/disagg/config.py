"""KVTransferConfig: `--kv-transfer-config` / `LLM(kv_transfer_config=...)`, vLLM's JSON keys
(docs/disaggregation.md §1)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import ConfigError
from ..json_flag import json_object

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("DeltaserveConnector",)
EXTRA_KEYS = ("handshake_timeout_s", "transfer_timeout_s", "hold_timeout_s", "max_transfer_bytes")


@dataclass(frozen=True)
class KVTransferConfig:
    """`kv_role`: kv_producer (a prefill instance: computes prompts and keeps their caches until a decode instance
    pulls them), kv_consumer (a decode instance: pulls them) or kv_both. `kv_ip`/`kv_port`: where a producer listens
    for pulls (port 0: a free one, logged and sent in each request's kv_transfer_params). `kv_connector_extra_config`:
    the timeouts of the stages (seconds: the handshake with a new peer, a pull's reply, how long a producer keeps
    a cache nobody pulls) and the largest payload a consumer accepts."""

    kv_role: str
    kv_connector: str = "DeltaserveConnector"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    handshake_timeout_s: float = 30.0
    transfer_timeout_s: float = 60.0
    hold_timeout_s: float = 120.0
    max_transfer_bytes: int = 8 << 30

    def __post_init__(self) -> None:
        if self.kv_role not in ROLES:
            raise ConfigError(f"kv_transfer_config.kv_role must be one of {list(ROLES)}, got {self.kv_role!r}")
        if self.kv_connector not in CONNECTORS:
            raise ConfigError(f"kv_transfer_config.kv_connector must be one of {list(CONNECTORS)}, got "
                              f"{self.kv_connector!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ConfigError(f"kv_transfer_config.kv_port must be a port number, got {self.kv_port!r}")
        for key in EXTRA_KEYS:
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"kv_transfer_config.kv_connector_extra_config.{key} must be > 0, got {value!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: "str | dict | KVTransferConfig | None") -> "KVTransferConfig | None":
        """A config from JSON text or a dict (None stays None); unknown keys and bad values raise ConfigError."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_object(value, "kv_transfer_config")
        extra = value.pop("kv_connector_extra_config", None) or {}
        if not isinstance(extra, dict):
            raise ConfigError("kv_transfer_config.kv_connector_extra_config must be a JSON object")
        top = {f.name for f in fields(cls)} - set(EXTRA_KEYS)
        unknown = sorted(set(value) - top) + sorted(f"kv_connector_extra_config.{k}" for k in set(extra) -
                                                    set(EXTRA_KEYS))
        if unknown:
            raise ConfigError(f"kv_transfer_config has unknown keys {unknown}; known: {sorted(top)} and "
                              f"kv_connector_extra_config's {list(EXTRA_KEYS)}")
        if "kv_role" not in value:
            raise ConfigError("kv_transfer_config needs 'kv_role'")
        return cls(**value, **extra)
