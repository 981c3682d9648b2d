"""Chat prompts -> token ids (docs/chat.md §2–4): `render_chat` picks the family's format.

K3 / K3.1 ship no Jinja template: their XTML format (docs/chat.md §3) is rendered natively, one segment at a time, so
that structural markers are special ids while every piece of message, tool, attribute and option text is encoded
with all specials disallowed (a literal `<|open|>` typed by a user stays ordinary text, §1.5). Text between two
consecutive special ids is encoded as one piece, exactly as a tokenizer that splits the rendered string at the
special tokens would encode it.

Kimi-Linear / K2 checkpoints carry a Jinja `chat_template` (§4), rendered in a sandbox with `tools` passed through;
only the special spellings of the template's own source become special ids, so request text never does (template.py
explains how).

Byte-level choices that docs/chat.md leaves open ([R] / "to be confirmed against encoding_k3") are marked `[R]` in
k3.py; the golden test of docs/chat.md §2 (ids from the checkpoint's own encoder) is the final word on them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..config import ModelConfig
from ..tokenizer import Tokenizer
from .base import ChatError, message_text
from .k3 import escape_attr, normalize_k3_messages, render_k3, sorted_json, unescape_attr
from .template import render_template

__all__ = ["ChatError", "message_text", "render_chat", "thinks_by_default", "render_k3", "render_template",
           "normalize_k3_messages", "escape_attr", "unescape_attr", "sorted_json"]


def thinks_by_default(tok: Tokenizer, config: ModelConfig) -> bool:
    """Whether a chat that does not say starts in a reasoning channel: always for K3 (its format has one, docs/chat.md
    §3.4); for a template family, when its template can open one (it writes `<think>` or reads a `thinking` /
    `enable_thinking` switch), so an instruct model without a reasoning channel answers in content."""
    if config.family == "kimi_k3":
        return True
    template = tok.chat_template or ""
    return any(mark in template for mark in ("<think>", "thinking"))


def render_chat(tok: Tokenizer, config: ModelConfig, messages: list[dict], add_generation_prompt: bool = True,
                thinking: bool = True, tools: list[dict] | None = None, tool_choice: Any = None,
                response_format: Any = None, thinking_effort: str | None = None,
                continue_final_message: bool = False, template_kwargs: Mapping[str, Any] | None = None,
                image_ids: Callable[[Mapping], list[int]] | None = None) -> list[int]:
    """Token ids of a conversation in the checkpoint's chat format, ending with the generation prompt.

    K3: `tool_choice` is "auto"/None (nothing), "required", "none" or a named-function object (rendered as nothing,
    [R]); `response_format` is None, {"type": "text"|"json_object"|"json_schema", ...}; `thinking_effort` is one of
    low/medium/high/max, default max in thinking mode; `template_kwargs` have no K3 rendering and are ignored.
    K2 family: the Jinja template gets `tools`, `thinking` and `template_kwargs`; `tool_choice`, `response_format`
    and `thinking_effort` have no K2 rendering and are ignored. Both: `continue_final_message` ends the prompt right
    after the final (assistant) message's content instead of closing it; `add_generation_prompt` must then be false.
    No text of `messages`, `tools` or `template_kwargs` ever becomes a special id. K3 user messages may hold image
    parts, rendered as the ids `image_ids` gives for each (its media run); the template family takes none.
    """
    if not messages:
        raise ChatError("messages must not be empty")
    if config.family == "kimi_k3":
        return render_k3(tok, messages, add_generation_prompt, thinking, tools=tools, tool_choice=tool_choice,
                         response_format=response_format, thinking_effort=thinking_effort,
                         continue_final_message=continue_final_message, image_ids=image_ids)
    return render_template(tok, messages, add_generation_prompt, tools=tools, thinking=thinking,
                           continue_final_message=continue_final_message, template_kwargs=template_kwargs)
