"""Chat prompts -> token ids (chat.md §2–3).

K3 / K3.1 ship no Jinja template: their XTML format is rendered natively, one segment at a time, so that structural
markers are special ids while message text is encoded with every special disallowed (a literal `<|open|>` typed by
a user stays ordinary text). Kimi-Linear / K2 checkpoints carry a Jinja `chat_template`, rendered in a sandbox.
This module covers plain conversations (system / developer / user / assistant, names, reasoning history);
tools, tool_choice and response_format arrive with the server's chat endpoints.
"""

from __future__ import annotations

from jinja2.sandbox import ImmutableSandboxedEnvironment

from .config import ModelConfig
from .errors import DeltaserveError
from .tokenizer import Tokenizer


class ChatError(DeltaserveError, ValueError):
    """A conversation that cannot be rendered (unknown role, bad content part, no template)."""


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def message_text(message: dict) -> str:
    """OpenAI content: a string, or a list of parts whose text parts are concatenated."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ChatError(f"unsupported content part {part!r}: only text parts are supported so far")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ChatError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def _attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


class _Ids:
    """Token ids built segment by segment: specials by name, text with specials disallowed."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.ids = tok, []

    def special(self, name: str) -> "_Ids":
        tid = self.tok.token_to_id(name)
        if tid is None:
            raise ChatError(f"the tokenizer has no special token {name}")
        self.ids.append(tid)
        return self

    def text(self, s: str) -> "_Ids":
        if s:
            self.ids.extend(self.tok.encode(s))
        return self

    def open(self, header: str) -> "_Ids":
        return self.special("<|open|>").text(header).special("<|sep|>")

    def close(self, name: str) -> "_Ids":
        return self.special("<|close|>").text(name).special("<|sep|>")


def render_k3(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
              thinking: bool = True) -> list[int]:
    out = _Ids(tok)
    for m in messages:
        role = _ROLES.get(m.get("role"))
        if role is None:
            raise ChatError(f"unsupported message role {m.get('role')!r}")
        header = f'message role="{role}"'
        if m.get("name"):
            header += f' name="{_attr(str(m["name"]))}"'
        out.open(header)
        if role == "assistant":
            if thinking:
                out.open("think").text(m.get("reasoning_content") or m.get("reasoning") or "").close("think")
            out.open("response").text(message_text(m)).close("response")
        else:
            out.text(message_text(m))
        out.close("message").special("<|end_of_msg|>")
    if add_generation_prompt:
        out.open('message role="assistant"').open("think" if thinking else "response")
    return out.ids


def render_template(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    if not tok.chat_template:
        raise ChatError("this checkpoint has no chat template")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    normalised = [{**m, "content": message_text(m)} for m in messages]
    text = env.from_string(tok.chat_template).render(messages=normalised,
                                                     add_generation_prompt=add_generation_prompt)
    # The template writes its markers as text; like transformers, encode the rendered string with specials on.
    return tok.encode(text, allow_special=True)


def render_chat(tok: Tokenizer, config: ModelConfig, messages: list[dict], add_generation_prompt: bool = True,
                thinking: bool = True) -> list[int]:
    """Token ids of a conversation in the checkpoint's chat format, ending with the generation prompt."""
    if not messages:
        raise ChatError("messages must not be empty")
    if config.family == "kimi_k3":
        return render_k3(tok, messages, add_generation_prompt, thinking)
    return render_template(tok, messages, add_generation_prompt)
