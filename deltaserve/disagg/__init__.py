"""Prefill/decode disaggregation (docs/disaggregation.md): what travels for one request (`payload`) and how it
travels (`wire`)."""

from .payload import KVPayload, cache_format, check_format, export_kv, import_kv, transfer_bytes
from .wire import decode_message, encode_message

__all__ = ["KVPayload", "cache_format", "check_format", "decode_message", "encode_message", "export_kv", "import_kv",
           "transfer_bytes"]
