"""What every chat format shares: the error type, the roles, and OpenAI content -> text."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import DeltaserveError


class ChatError(DeltaserveError, ValueError):
    """A conversation that cannot be rendered (unknown role, bad content part, no template, bad option)."""


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def message_text(message: Mapping) -> str:
    """OpenAI content: a string, or a list of parts whose text parts are concatenated (docs/chat.md §3.2 item 3).

    Image parts would become `<|kimi_image_placeholder|>` once vision is built; images are not supported yet, so any
    non-text part raises a ChatError naming the part.
    """
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text":
                what = f"type {kind!r}" if kind is not None else repr(part)[:80]
                raise ChatError(f"unsupported content part {i} ({what}) in a {message.get('role')!r} message: "
                                "only text parts are supported (images are not supported yet)")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise ChatError(f"content part {i} of a {message.get('role')!r} message: 'text' must be a string")
            texts.append(text)
        return "".join(texts)
    raise ChatError(f"message content must be a string or a list of parts, got {type(content).__name__}")
