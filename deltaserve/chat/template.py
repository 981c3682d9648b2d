"""Kimi-Linear / K2 prompts from the checkpoint's Jinja `chat_template` (docs/chat.md §4), rendered in a sandbox.

Special tokens come only from the template's own source, never from request data. Before each render every special
token spelled in the template source (in literal text, string constants and comments alike) is replaced by a
sentinel: a private-use character, a random per-render nonce (128 bits from `secrets`), the token's id and a closing
private-use character. The template is compiled from that source and rendered with the request's data untouched.
In the output, only sentinels of this render's nonce become special ids; every piece of text between two of them is
encoded as one piece with all specials disallowed. A special token's spelling typed into message content, a `name`,
a `tool_call_id`, a tool definition, tool-call arguments, reasoning text or a chat_template_kwargs value is therefore
plain text, whatever the template does with that data.

Why sentinels in the template rather than markers around user strings: markers around data must survive every
filter the template may apply (`trim` would stop at a marker, `tojson` escapes, slicing and `split` cut markers off,
dict keys of tool schemas are data too), and any filter that drops a marker would let user text through as
specials. Sentinels never pass through a filter that sees user data, and user data cannot contain a sentinel,
because the nonce is drawn after the request is read and never leaves this module (exception messages are scrubbed
back to token names). Injection is impossible by construction.

Exact in the benign case: with no special spelling in the request data, the rendered string is the one the template
produced before, with each special spelling swapped one-for-one for its sentinel, and each run of text between two
specials is encoded as one piece, just as a tokenizer that splits the rendered string at the specials encodes it
(template text and user text inside that run get the same BPE merges as before). Two things differ by design:
a special that the template assembles at run time (`'<|im_' ~ 'end|>'`) or reads from a variable is text, and a
template test of data against a special spelling (`'</think>' in content`) no longer matches request text. Neither
occurs in the shipped templates.

`continue_final_message`: the final message's content gets a second per-render sentinel appended; the rendered
string is cut where the last copy of it appears, so the prompt ends right after that content (the template's
closing markers for it are dropped). A template that does not print the content cannot be continued (ChatError).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..tokenizer import Tokenizer
from .base import _ROLES, ChatError, message_text

# Plane-15 private-use characters: no template or tokenizer gives them a meaning, and Jinja treats them as text.
_SPECIAL_OPEN, _SPECIAL_CLOSE = "\U000F0000", "\U000F0001"
_CONTINUE_MARK = "\U000F0002"

# Names the renderer itself passes to the template; chat_template_kwargs may not rebind them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "tools", "thinking", "enable_thinking",
                                     "raise_exception"})


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


class _Sentinels:
    """One render's sentinels: special spellings in the template source -> unguessable stand-ins, and back."""

    def __init__(self, tok: Tokenizer, source: str):
        self.nonce = secrets.token_hex(16)
        present = {name: tid for name, tid in tok.special_tokens.items() if name in source}
        # Longest first, so that a name containing another name is replaced whole.
        self._names = re.compile("|".join(re.escape(n) for n in sorted(present, key=len, reverse=True))) \
            if present else None
        self._ids = present
        self._names_by_id = {tid: name for name, tid in present.items()}
        self._found = re.compile(re.escape(_SPECIAL_OPEN + self.nonce + ":") + r"(\d+)" + re.escape(_SPECIAL_CLOSE))
        self.continue_mark = _CONTINUE_MARK + self.nonce + _CONTINUE_MARK

    def protect(self, source: str) -> str:
        if self._names is None:
            return source
        return self._names.sub(lambda m: f"{_SPECIAL_OPEN}{self.nonce}:{self._ids[m.group()]}{_SPECIAL_CLOSE}",
                               source)

    def reveal(self, text: str) -> str:
        """`text` with this render's sentinels spelled as token names again (for error messages)."""
        text = self._found.sub(lambda m: self._names_by_id.get(int(m.group(1)), m.group()), text)
        return text.replace(self.continue_mark, "")

    def ids(self, tok: Tokenizer, text: str) -> list[int]:
        """Sentinels -> their special ids; the text between two of them -> one piece, specials disallowed."""
        out: list[int] = []
        start = 0
        for m in self._found.finditer(text):
            if m.start() > start:
                out.extend(tok.encode(text[start:m.start()], allow_special=False))
            out.append(int(m.group(1)))
            start = m.end()
        if start < len(text):
            out.extend(tok.encode(text[start:], allow_special=False))
        return out


def render_template(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, thinking: bool = True, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """K2-family prompt ids from the checkpoint's Jinja `chat_template` (docs/chat.md §4).

    The template gets `messages` (content flattened to a string), `add_generation_prompt`, `tools`, `thinking` and
    its alias `enable_thinking`, plus `template_kwargs` (which may not rebind those names). With
    `continue_final_message` the prompt ends right after the final message's content (`add_generation_prompt` must
    be false). Raises ChatError for a bad conversation, a reserved kwarg or a failing template.
    """
    if not tok.chat_template:
        raise ChatError("this checkpoint has no chat template")
    extra = dict(template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_NAMES & extra.keys())
    if clash:
        raise ChatError(f"chat_template_kwargs may not set {', '.join(clash)}: the renderer sets them")
    if continue_final_message and add_generation_prompt:
        raise ChatError("continue_final_message and add_generation_prompt cannot both be true")
    normalised = [_template_message(m) for m in messages]
    sentinels = _Sentinels(tok, tok.chat_template)
    if continue_final_message:
        if not normalised:
            raise ChatError("continue_final_message needs a final message to continue")
        last = normalised[-1]
        normalised[-1] = {**last, "content": last["content"] + sentinels.continue_mark}
    try:
        template = _template_env().from_string(sentinels.protect(tok.chat_template))
        text = template.render(messages=normalised, add_generation_prompt=add_generation_prompt, tools=tools or None,
                               thinking=thinking, enable_thinking=thinking, **extra)
    except ChatError as exc:
        raise ChatError(sentinels.reveal(str(exc))) from None
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as exc:
        # The template is fixed, so a failure comes from this request's data (a tool schema of an unexpected
        # shape, an unsupported kwarg value): answer it as a bad request, never as a server error.
        raise ChatError(f"the chat template failed: {sentinels.reveal(str(exc))}") from None
    if continue_final_message:
        cut = text.rfind(sentinels.continue_mark)
        if cut < 0:
            raise ChatError("continue_final_message: the chat template does not print the final message's content, "
                            "so it cannot be continued")
        text = text[:cut].replace(sentinels.continue_mark, "")
    return sentinels.ids(tok, text)
