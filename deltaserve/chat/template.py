"""Kimi-Linear / K2 prompts from the checkpoint's Jinja `chat_template` (chat.md §4), rendered in a sandbox."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..tokenizer import Tokenizer
from .base import _ROLES, ChatError, message_text


def _template_message(m: Mapping) -> dict:
    if not isinstance(m, Mapping):
        raise ChatError(f"messages must be objects, got {type(m).__name__}")
    if m.get("role") not in _ROLES:
        raise ChatError(f"unsupported message role {m.get('role')!r}")
    return {**m, "content": message_text(m)}


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson` (the environment Kimi's templates are written for): plain json.dumps, no HTML escaping,
    keys in given order, non-ASCII kept. Jinja's own filter would sort keys and escape `<`, `>`, `&`, `'`."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatError(f"chat template: {message}")


def _template_env() -> ImmutableSandboxedEnvironment:
    """A sandbox configured like transformers' apply_chat_template."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


def render_template(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, thinking: bool = True, **template_kwargs: Any) -> list[int]:
    """K2-family prompt from the checkpoint's Jinja `chat_template` (chat.md §4), with `tools` passed through."""
    if not tok.chat_template:
        raise ChatError("this checkpoint has no chat template")
    env = _template_env()
    normalised = [_template_message(m) for m in messages]
    try:
        text = env.from_string(tok.chat_template).render(
            messages=normalised, add_generation_prompt=add_generation_prompt, tools=tools or None,
            thinking=thinking, enable_thinking=thinking, **template_kwargs)
    except TemplateError as exc:
        raise ChatError(f"the chat template failed: {exc}") from exc
    # The template writes its markers as text; like transformers, encode the rendered string with specials on.
    return tok.encode(text, allow_special=True)
