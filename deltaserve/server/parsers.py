"""Model output -> `reasoning_content`, `content`, `tool_calls` (chat.md §3.4–3.6 for K3, §4 for K2/Kimi-Linear).

Both parsers work on **token ids** (chat.md §3.6): structural markers are special ids that user, tool and model
text can never produce, so parsing is a state machine keyed on those ids that decodes only the text between them.
The result does not depend on `skip_special_tokens` or on spacing between special tokens, and a string argument
that literally contains `<|close|>argument<|sep|>` is parsed correctly.

One state machine serves both interfaces: `XOutputParser.parse(ids)` runs a fresh `XStreamParser` over all ids and
assembles its deltas, so the streamed deltas of any chunking reassemble exactly the non-streamed parse.

Streaming rules:
* reasoning and content are emitted as soon as their bytes form complete UTF-8 characters (an incomplete character
  is held back until its marker or `finish()`, then becomes U+FFFD, like `Tokenizer.decode`);
* a tool call is emitted only once its closing marker has arrived, as one delta carrying `index`, `id`, `name` and the
  whole `arguments` JSON (chat.md §3.5, vLLM behaviour); a call cut off by `max_tokens` is never emitted. With
  `stream_arguments=True` the first delta of a call (`index`, `id`, `name`, `arguments=""`) is sent when the call
  opens and argument fragments follow as they are generated (string values character by character); a call that
  is cut off or malformed is then left unfinished in the stream while `parse` drops it — the only case where the
  two differ.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..config import ModelConfig
from ..tokenizer import Tokenizer

__all__ = [
    "ToolCall", "ParsedOutput", "ToolCallDelta", "Delta", "assemble", "default_call_id",
    "K3OutputParser", "K3StreamParser", "K2OutputParser", "K2StreamParser", "PlainOutputParser",
    "PlainStreamParser", "parser_for",
]  # fmt: skip


# ------------------------------------------------------------------------------------------------ data classes
@dataclass
class ToolCall:
    id: str
    name: str
    arguments_json: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass
class ParsedOutput:
    reasoning_content: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    # Generated ids that were reasoning text (usage.completion_tokens_details.reasoning_tokens). Set by `parse`;
    # `assemble` cannot know it (0), so it is left out of equality.
    reasoning_tokens: int = field(default=0, compare=False)


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call; `id` and `name` are set on the first delta of a call only."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def to_openai(self) -> dict:
        """The `delta` object of a chat.completion.chunk (unset fields left out)."""
        out: dict[str, Any] = {}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            calls = []
            for tc in self.tool_calls:
                call: dict[str, Any] = {"index": tc.index}
                if tc.id is not None:
                    call["id"] = tc.id
                    call["type"] = "function"
                function: dict[str, Any] = {"arguments": tc.arguments}
                if tc.name is not None:
                    function = {"name": tc.name, "arguments": tc.arguments}
                call["function"] = function
                calls.append(call)
            out["tool_calls"] = calls
        return out


def assemble(deltas: Iterable[Delta]) -> ParsedOutput:
    """Concatenate streamed deltas into the equivalent non-streamed result."""
    reasoning: list[str] | None = None
    content: list[str] = []
    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
    for d in deltas:
        if d.reasoning_content is not None:
            reasoning = (reasoning or []) + [d.reasoning_content]
        if d.content is not None:
            content.append(d.content)
        for tc in d.tool_calls:
            slot = calls.setdefault(tc.index, ["", "", ""])
            if tc.id is not None:
                slot[0] = tc.id
            if tc.name is not None:
                slot[1] = tc.name
            slot[2] += tc.arguments
    return ParsedOutput(
        reasoning_content=None if reasoning is None else "".join(reasoning),
        content="".join(content),
        tool_calls=[ToolCall(*calls[i]) for i in sorted(calls)],
    )


def _parse(stream: "_StreamBase", token_ids: Iterable[int]) -> ParsedOutput:
    parsed = assemble(stream.feed(token_ids) + stream.finish())
    parsed.reasoning_tokens = stream.reasoning_tokens
    return parsed


def default_call_id(name: str, index: int) -> str:
    """Deterministic OpenAI tool-call id: Kimi's `functions.{name}:{0-based call index}` (chat.md §4).

    For K3, chat.md §3.5 suggests random `call_…` ids plus a map to the renderer's `"{name}:{index-1}"` alias; a
    deterministic id needs no map: clients echo it in the assistant history and in `tool_call_id`, where the
    renderer matches it exactly (and its `name:position` alias still works for clients that rewrite ids).
    """
    return f"functions.{name}:{index}"


def _json_compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# ------------------------------------------------------------------------------------------------- base stream
class _StreamBase:
    """Delta bookkeeping shared by the stream parsers: coalescing, UTF-8 spans and the tool-call emitter."""

    def __init__(self, tok: Tokenizer, thinking: bool, stream_arguments: bool,
                 make_id: Callable[[str, int], str] | None):
        self.tok = tok
        self.thinking = thinking
        self.stream_arguments = stream_arguments
        self.make_id = make_id or default_call_id
        self._out: list[Delta] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_calls = 0  # calls announced (stream_arguments) or emitted (buffered)
        self._call: list | None = None  # [index or None, id, name, [fragments], announced]
        self._stop_ids = {i for i in (tok.token_to_id("[EOS]"),) if i is not None}
        self.done = False
        self.state = "content"
        self.reasoning_tokens = 0  # text ids consumed while reasoning (marker headers excluded)
        self._header: bytearray | None = None  # bytes of a marker header being read

    # -- output --------------------------------------------------------------------------------------------------
    def _emit(self, kind: str, text: str) -> None:
        if not text:
            return
        last = self._out[-1] if self._out else None
        if kind == "reasoning":
            if last is not None and last.reasoning_content is not None:
                last.reasoning_content += text
            else:
                self._out.append(Delta(reasoning_content=text))
        elif kind == "content":
            if last is not None and last.content is not None:
                last.content += text
            else:
                self._out.append(Delta(content=text))

    def _emit_call(self, tc: ToolCallDelta) -> None:
        last = self._out[-1] if self._out else None
        if last is not None and last.tool_calls and tc.id is None and last.tool_calls[-1].index == tc.index:
            last.tool_calls[-1].arguments += tc.arguments
        elif last is not None and last.tool_calls and last.reasoning_content is None and last.content is None:
            last.tool_calls.append(tc)
        else:
            self._out.append(Delta(tool_calls=[tc]))

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    # -- text spans ----------------------------------------------------------------------------------------------
    def _text_bytes(self, data: bytes) -> None:
        text = self._utf8.decode(data, final=False)
        if text:
            self._route(text)

    def _end_span(self) -> None:
        """A marker arrived: the text before it is complete (an unfinished character becomes U+FFFD)."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        if text:
            self._route(text)

    def _route(self, text: str) -> None:  # overridden: sends text to reasoning / content / an argument
        self._emit("content", text)

    # -- tool calls ----------------------------------------------------------------------------------------------
    def _call_begin(self, name: str, call_id: str | None = None) -> None:
        self._call_abandon()
        call = [None, call_id, name, [], False]
        self._call = call
        if self.stream_arguments:
            call[0] = self._num_calls
            self._num_calls += 1
            call[1] = call_id or self.make_id(name, call[0])
            call[4] = True
            self._emit_call(ToolCallDelta(index=call[0], id=call[1], name=name, arguments=""))

    def _call_fragment(self, text: str) -> None:
        if self._call is None or not text:
            return
        self._call[3].append(text)
        if self._call[4]:
            self._emit_call(ToolCallDelta(index=self._call[0], arguments=text))

    def _call_end(self) -> None:
        call, self._call = self._call, None
        if call is None:
            return
        if not call[4]:
            index = self._num_calls
            self._num_calls += 1
            call_id = call[1] or self.make_id(call[2], index)
            self._emit_call(ToolCallDelta(index=index, id=call_id, name=call[2], arguments="".join(call[3])))

    def _call_abandon(self) -> None:
        """Drop an unfinished call (buffered mode: nothing was sent; streaming mode: it stays unfinished)."""
        self._call = None

    # -- public --------------------------------------------------------------------------------------------------
    def feed(self, new_token_ids: Iterable[int]) -> list[Delta]:
        """Consume newly generated ids; return the deltas they complete (possibly none)."""
        for t in new_token_ids:
            if self.done:
                break
            t = int(t)
            if self.state == "reasoning" and self._header is None and not self.tok.is_special(t):
                self.reasoning_tokens += 1
            self._token(t)
        return self._take()

    def finish(self) -> list[Delta]:
        """End of generation: flush a held-back partial character; an unfinished tool call is dropped."""
        if not self.done:
            self._finish()
        self.done = True
        return self._take()

    def _finish(self) -> None:
        self._end_span()
        self._call_abandon()

    def _token(self, t: int) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


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
    """Incremental K3 XTML output parser on token ids (chat.md §3.4–3.6).

    States: `reasoning` (thinking mode starts here: the think opener is in the prompt), `content` (the response
    channel; thinking disabled starts here), `top` (between channels), `tools`, `call`, `argument`, `json`, `done`.

    Rules:
    * reasoning ends at `<|close|>think<|sep|>`, and also at a response marker seen while reasoning (SGLang's
      zero-length think); an `<|open|>think<|sep|>` outside the tools channel (re)enters reasoning;
    * with thinking disabled everything outside the tools channel is content (think markers are dropped);
    * stray text between channels is content; unknown elements have their markers dropped;
    * arguments: `type="string"` -> the raw text; other types -> JSON-decoded (raw text kept as a string if it is not
      valid JSON); the call's `arguments_json` is the compact JSON object of its arguments in order, first
      occurrence of a key winning; a `json` element (history fallback form, chat.md §3.3) gives the arguments
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


# ----------------------------------------------------------------------------------------------- K2 / Kimi-Linear
_K2_ID_RE = re.compile(r"^(?P<name>.+):\d+$", re.S)


def k2_name_from_id(call_id: str) -> str:
    """`functions.NAME:IDX` -> NAME (the part between `functions.` and the final `:N`, chat.md §4)."""
    m = _K2_ID_RE.match(call_id)
    name = m.group("name") if m else call_id
    return name.removeprefix("functions.")


class K2StreamParser(_StreamBase):
    """Incremental K2 / Kimi-Linear parser on token ids (chat.md §4).

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


def parser_for(config: ModelConfig, tokenizer: Tokenizer,
               make_id: Callable[[str, int], str] | None = None) -> K3OutputParser | K2OutputParser | PlainOutputParser:
    """The output parser of a model family: K3 XTML, K2 section markers (Kimi-Linear), or plain content."""
    if config.family == "kimi_k3":
        return K3OutputParser(tokenizer, make_id)
    if config.family == "kimi_linear":
        return K2OutputParser(tokenizer, make_id)
    return PlainOutputParser(tokenizer, make_id)
