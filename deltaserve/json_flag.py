"""A flag whose value is a JSON object (`--speculative-config`, `--kv-transfer-config`), given as text or a dict."""

from __future__ import annotations

import json

from .errors import ConfigError


def json_object(value: "str | dict", name: str) -> dict:
    """`value` as a dict: JSON text parsed, a dict copied; ConfigError naming the flag `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object, got {type(value).__name__}")
    return dict(value)
