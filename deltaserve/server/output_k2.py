"""K2 / Kimi-Linear output parser (docs/chat.md §4) and the plain fallback for families without markers."""

from __future__ import annotations

import re
from collections.abc import Callable

from ..tokenizer import Tokenizer
from .output_base import ParsedOutput, _parse, _StreamBase


# ----------------------------------------------------------------------------------------------- K2 / Kimi-Linear
_K2_ID_RE = re.compile(r"^(?P<name>.+):\d+$", re.S)


def k2_name_from_id(call_id: str) -> str:
    """`functions.NAME:IDX` -> NAME (the part between `functions.` and the final `:N`, docs/chat.md §4)."""
    m = _K2_ID_RE.match(call_id)
    name = m.group("name") if m else call_id
    return name.removeprefix("functions.")


class K2StreamParser(_StreamBase):
    """Incremental K2 / Kimi-Linear parser on token ids (docs/chat.md §4).

    Thinking mode starts in reasoning (the K2-Thinking prompt may or may not contain `<think>`; a generated
    `<think>` is dropped); reasoning ends at `</think>` or at `<|tool_calls_section_begin|>`. Each
    `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>` yields a call with the model's own id
    (`functions.NAME:IDX`), the name taken from it, and ARGS verbatim (`{}` when empty). Text after the tool-call
    section is dropped (vLLM). `<|im_end|>` / `[EOS]` end parsing.
    """

    _NAMES = ("<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
              "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_end|>")

    def __init__(self, tok: Tokenizer, thinking: bool = True, stream_arguments: bool = False,
                 make_id: Callable[[str, int], str] | None = None):
        super().__init__(tok, thinking, stream_arguments, make_id)
        ids = {name: tok.token_to_id(name) for name in self._NAMES}
        missing = [name for name, i in ids.items() if i is None and name not in ("<think>", "</think>")]
        if missing:
            raise ValueError(f"the tokenizer lacks the K2 tool-call markers {missing}")
        self._ids = {i: name for name, i in ids.items() if i is not None}
        self._stop_ids.add(ids["<|im_end|>"])
        self.state = "reasoning" if thinking else "content"
        self._args_sent = False

    def _route(self, text: str) -> None:
        if self.state == "reasoning":
            self._emit("reasoning", text)
        elif self.state == "content":
            self._emit("content", text)
        elif self.state == "args":
            self._args_sent = True
            self._call_fragment(text)

    def _token(self, t: int) -> None:
        if t in self._stop_ids:
            self._finish()
            self.done = True
            return
        name = self._ids.get(t)
        if name is None:
            if self._header is not None:
                self._header += self.tok.id_to_bytes(t)
            else:
                self._text_bytes(self.tok.id_to_bytes(t))
            return
        self._end_span()
        s = self.state
        if name == "</think>":
            if s == "reasoning":
                self.state = "content"
        elif name == "<|tool_calls_section_begin|>":
            if s in ("reasoning", "content"):
                self.state = "section"
        elif name == "<|tool_call_begin|>":
            if s in ("section", "args", "header"):
                self._call_abandon()
                self._header = bytearray()
                self.state = "header"
        elif name == "<|tool_call_argument_begin|>":
            if s == "header":
                call_id = self._header.decode("utf-8", errors="replace").strip()
                self._header = None
                fn = k2_name_from_id(call_id)
                if fn:
                    self._call_begin(fn, call_id)
                    self._args_sent = False
                    self.state = "args"
                else:
                    self.state = "section"
        elif name in ("<|tool_call_end|>", "<|tool_calls_section_end|>"):
            if s == "args":
                if not self._args_sent:
                    self._call_fragment("{}")
                self._call_end()
            elif s == "header":
                self._header = None
            if s in ("args", "header", "section"):
                self.state = "section" if name == "<|tool_call_end|>" else "after"
        # `<think>` and markers out of place are dropped


class K2OutputParser:
    """Non-streamed K2 / Kimi-Linear output parsing on token ids; `stream()` gives the incremental form."""

    def __init__(self, tokenizer: Tokenizer, make_id: Callable[[str, int], str] | None = None):
        self.tokenizer = tokenizer
        self.make_id = make_id
        K2StreamParser(tokenizer)

    def stream(self, thinking: bool = True, stream_arguments: bool = False) -> K2StreamParser:
        return K2StreamParser(self.tokenizer, thinking, stream_arguments, self.make_id)

    def parse(self, token_ids: list[int], thinking: bool = True) -> ParsedOutput:
        return _parse(self.stream(thinking), token_ids)


# --------------------------------------------------------------------------------------------------- fallback
class PlainStreamParser(_StreamBase):
    """Families without a reasoning/tool format here (DeepSeek): all text is content; special ids are dropped."""

    def __init__(self, tok: Tokenizer, thinking: bool = True, stream_arguments: bool = False,
                 make_id: Callable[[str, int], str] | None = None):
        super().__init__(tok, thinking, stream_arguments, make_id)

    def _token(self, t: int) -> None:
        if not self.tok.is_special(t):
            self._text_bytes(self.tok.id_to_bytes(t))


class PlainOutputParser:
    def __init__(self, tokenizer: Tokenizer, make_id: Callable[[str, int], str] | None = None):
        self.tokenizer = tokenizer
        self.make_id = make_id

    def stream(self, thinking: bool = True, stream_arguments: bool = False) -> PlainStreamParser:
        return PlainStreamParser(self.tokenizer, thinking, stream_arguments, self.make_id)

    def parse(self, token_ids: list[int], thinking: bool = True) -> ParsedOutput:
        return _parse(self.stream(thinking), token_ids)
