"""What every chat format shares: the error type, the roles, and OpenAI content -> text."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import DeltaserveError


class ChatError(DeltaserveError, ValueError):
    """A conversation that cannot be rendered (unknown role, bad content part, no template, bad option)."""


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


IMAGE_PARTS = ("image_url", "image")


def message_parts(message: Mapping) -> list:
    """OpenAI content as pieces: strings for text parts, the part itself (a Mapping) for an image part (`image_url`:
    {"url": ...}, or `image`); ChatError naming any other part."""
    content = message.get("content")
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ChatError(f"message content must be a string or a list of parts, got {type(content).__name__}")
    pieces = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in IMAGE_PARTS:
            pieces.append(part)
            continue
        if kind != "text":
            what = f"type {kind!r}" if kind is not None else repr(part)[:80]
            raise ChatError(f"unsupported content part {i} ({what}) in a {message.get('role')!r} message: only "
                            f"text and image parts are supported")
        text = part.get("text", "")
        if not isinstance(text, str):
            raise ChatError(f"content part {i} of a {message.get('role')!r} message: 'text' must be a string")
        pieces.append(text)
    return pieces


def message_text(message: Mapping) -> str:
    """OpenAI content: a string, or a list of parts whose text parts are concatenated (docs/chat.md §3.2 item 3); an
    image part is a ChatError (only a K3 user message takes images: k3.py renders those with `message_parts`)."""
    pieces = message_parts(message)
    for i, piece in enumerate(pieces):
        if not isinstance(piece, str):
            raise ChatError(f"content part {i} (type {piece.get('type')!r}) of a {message.get('role')!r} message is "
                            f"an image: images go only in K3 user messages to a model with a vision tower")
    return "".join(pieces)
