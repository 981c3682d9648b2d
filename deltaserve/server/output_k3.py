"""K3 / K3.1 XTML output parser on token ids (docs/chat.md §3.4–3.6)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from ..tokenizer import Tokenizer
from .output_base import ParsedOutput, _json_compact, _parse, _StreamBase


# -------------------------------------------------------------------------------------------------------- K3
_ATTR_RE = re.compile(r'([A-Za-z_][\w\-]*)="([^"]*)"')


def _parse_header(header: str) -> tuple[str, dict[str, str]]:
    """`NAME KEY="VALUE" ...` -> (NAME, {KEY: unescaped VALUE}); the first occurrence of a key wins."""
    name, _, rest = header.partition(" ")
    attrs: dict[str, str] = {}
    for key, value in _ATTR_RE.findall(rest):
        attrs.setdefault(key, value.replace("&quot;", '"').replace("&amp;", "&"))
    return name.strip(), attrs


class K3StreamParser(_StreamBase):
    """Incremental K3 XTML output parser on token ids (docs/chat.md §3.4–3.6).

    States: `reasoning` (thinking mode starts here: the think opener is in the prompt), `content` (the response
    channel; thinking disabled starts here), `top` (between channels), `tools`, `call`, `argument`, `json`, `done`.

    Rules:
    * reasoning ends at `<|close|>think<|sep|>`, and also at a response marker seen while reasoning (SGLang's
      zero-length think); an `<|open|>think<|sep|>` outside the tools channel (re)enters reasoning;
    * with thinking disabled everything outside the tools channel is content (think markers are dropped);
    * stray text between channels is content; unknown elements have their markers dropped;
    * arguments: `type="string"` -> the raw text; other types -> JSON-decoded (raw text kept as a string if it is not
      valid JSON); the call's `arguments_json` is the compact JSON object of its arguments in order, first
      occurrence of a key winning; a `json` element (history fallback form, docs/chat.md §3.3) gives the arguments
      verbatim; a call without a `tool` attribute is dropped;
    * `<|close|>message<|sep|>`, `<|end_of_msg|>` or `[EOS]` ends parsing.
    """

    def __init__(self, tok: Tokenizer, thinking: bool = True, stream_arguments: bool = False,
                 make_id: Callable[[str, int], str] | None = None):
        super().__init__(tok, thinking, stream_arguments, make_id)
        ids = {name: tok.token_to_id(name) for name in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")}
        missing = [name for name, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"the tokenizer lacks the K3 markers {missing}; is this a K3 checkpoint?")
        self._open, self._close, self._sep = ids["<|open|>"], ids["<|close|>"], ids["<|sep|>"]
        self._stop_ids.add(ids["<|end_of_msg|>"])
        self.state = "reasoning" if thinking else "content"
        self._header_kind = ""  # "open" | "close"
        # current argument: [key, type, [text pieces], skip, streaming (string value sent as it comes), is_json]
        self._arg: list | None = None
        self._call_mode = ""  # "" (no arguments yet) | "args" | "json"
        self._call_skip = False  # a call without a tool name: parse it, emit nothing
        self._seen_keys: set[str] = set()

    # -- token dispatch ------------------------------------------------------------------------------------------
    def _token(self, t: int) -> None:
        if t in self._stop_ids:
            self._finish()
            self.done = True
            return
        if self._header is not None:
            if t == self._sep:
                header = self._header.decode("utf-8", errors="replace")
                self._header = None
                if self._header_kind == "open":
                    self._on_open(*_parse_header(header))
                else:
                    self._on_close(header.strip())
            elif t in (self._open, self._close):  # malformed: restart the header
                self._header = bytearray()
                self._header_kind = "open" if t == self._open else "close"
            else:
                self._header += self.tok.id_to_bytes(t)
            return
        if t in (self._open, self._close):
            self._end_span()
            self._header = bytearray()
            self._header_kind = "open" if t == self._open else "close"
        elif t == self._sep:
            pass  # a stray separator carries nothing
        else:
            self._text_bytes(self.tok.id_to_bytes(t))

    def _route(self, text: str) -> None:
        s = self.state
        if s == "reasoning":
            self._emit("reasoning", text)
        elif s in ("content", "top"):
            self._emit("content", text)
        elif s in ("argument", "json"):
            self._arg_text(text)
        # text between calls / arguments / after the message is dropped

    # -- elements ------------------------------------------------------------------------------------------------
    def _on_open(self, name: str, attrs: dict[str, str]) -> None:
        s = self.state
        if s in ("reasoning", "content", "top"):
            if name == "think":
                if self.thinking:
                    self.state = "reasoning"
            elif name == "response":
                self.state = "content"
            elif name == "tools":
                self.state = "tools"
            elif name == "call":  # a call without the tools opener: accept it
                self._open_call(attrs)
        elif s == "tools":
            if name == "call":
                self._open_call(attrs)
        elif s == "call":
            if name == "argument":
                self._open_arg(attrs.get("key"), attrs.get("type", "string"), is_json=False)
            elif name == "json":
                self._open_arg(None, attrs.get("type", "object"), is_json=True)
            elif name == "call":  # the previous call never closed
                self._open_call(attrs)
        elif s in ("argument", "json"):
            # An element opened inside an argument body: the argument never closed. The call is malformed; drop it
            # (a later `call` still parses).
            self._drop_call()
            self.state = "tools"
            self._on_open(name, attrs)

    def _on_close(self, name: str) -> None:
        s = self.state
        if name == "message":
            if s in ("call", "argument", "json"):
                self._drop_call()
            self.state = "done"
            self.done = True
            self._finish()
            return
        if s == "reasoning":
            if name in ("think", "response"):
                self.state = "top"
        elif s == "content":
            if name == "response":
                self.state = "top"
        elif s == "tools":
            if name == "tools":
                self.state = "top"
        elif s == "call":
            if name == "call":
                self._close_call()
                self.state = "tools"
            elif name == "tools":
                self._drop_call()
                self.state = "top"
        elif s in ("argument", "json"):
            if name == ("argument" if s == "argument" else "json"):
                self._close_arg()
                self.state = "call"
            elif name in ("call", "tools"):  # argument never closed: drop the call
                self._arg = None
                self._drop_call()
                self.state = "tools" if name == "call" else "top"

    # -- calls and arguments -------------------------------------------------------------------------------------
    def _open_call(self, attrs: dict[str, str]) -> None:
        self._drop_call()
        name = attrs.get("tool", "")
        self._call_skip = not name
        self._call_mode = ""
        self._seen_keys = set()
        self.state = "call"
        if not self._call_skip:
            self._call_begin(name)

    def _drop_call(self) -> None:
        self._arg = None
        self._call_abandon()
        self._call_skip = False

    def _close_call(self) -> None:
        if self._call_skip:
            self._call_skip = False
            return
        if self._call_mode == "args":
            self._call_fragment("}")
        elif self._call_mode == "":
            self._call_fragment("{}")
        self._call_end()

    def _open_arg(self, key: str | None, kind: str, is_json: bool) -> None:
        skip = self._call_skip
        if is_json:
            skip = skip or self._call_mode != ""  # only a call's sole form of arguments
        else:
            skip = skip or key is None or self._call_mode == "json" or key in self._seen_keys
        self._arg = [key, kind, [], skip, False, is_json]
        self.state = "json" if is_json else "argument"
        if skip:
            return
        if is_json:
            self._call_mode = "json"
            return
        self._seen_keys.add(key)
        if kind == "string" and self.stream_arguments:
            self._arg_prefix(key, open_string=True)
            self._arg[4] = True

    def _arg_prefix(self, key: str, open_string: bool) -> None:
        prefix = "{" if self._call_mode == "" else ","
        self._call_mode = "args"
        self._call_fragment(prefix + _json_compact(key) + ":" + ('"' if open_string else ""))

    def _arg_text(self, text: str) -> None:
        arg = self._arg
        if arg is None or arg[3]:
            return
        if arg[5]:  # json element: verbatim
            self._call_fragment(text)
        elif arg[4]:  # streaming a string value: JSON-escape per character, so fragments concatenate
            self._call_fragment(_json_compact(text)[1:-1])
        else:
            arg[2].append(text)

    def _close_arg(self) -> None:
        arg, self._arg = self._arg, None
        if arg is None or arg[3] or arg[5]:
            return
        if arg[4]:
            self._call_fragment('"')
            return
        raw = "".join(arg[2])
        if arg[1] == "string":
            value: Any = raw
        else:
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw  # not valid JSON for its declared type: keep the text (vLLM does the same)
        self._arg_prefix(arg[0], open_string=False)
        self._call_fragment(_json_compact(value))


class K3OutputParser:
    """Non-streamed K3 output parsing on token ids; `stream()` gives the incremental form."""

    def __init__(self, tokenizer: Tokenizer, make_id: Callable[[str, int], str] | None = None):
        self.tokenizer = tokenizer
        self.make_id = make_id
        K3StreamParser(tokenizer)  # validate the markers now

    def stream(self, thinking: bool = True, stream_arguments: bool = False) -> K3StreamParser:
        return K3StreamParser(self.tokenizer, thinking, stream_arguments, self.make_id)

    def parse(self, token_ids: list[int], thinking: bool = True) -> ParsedOutput:
        return _parse(self.stream(thinking), token_ids)
