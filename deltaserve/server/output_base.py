"""Shared pieces of the output parsers: result and delta types, and the token-id state machine base. See
`deltaserve.server.parsers` for the parsing rules."""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..tokenizer import Tokenizer

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
    """Deterministic OpenAI tool-call id: Kimi's `functions.{name}:{0-based call index}` (docs/chat.md §4).

    For K3, docs/chat.md §3.5 suggests random `call_…` ids plus a map to the renderer's `"{name}:{index-1}"` alias; a
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
