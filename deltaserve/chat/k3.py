"""Kimi K3 / K3.1 XTML chat renderer (docs/chat.md §3), native: markers are special ids, all message, tool, attribute
and option text is encoded with every special disallowed (a literal `<|open|>` typed by a user stays ordinary text,
§1.5). Text between two consecutive special ids is encoded as one piece, exactly as a tokenizer that splits the
rendered string at the special tokens would encode it.

Byte-level choices that docs/chat.md leaves open ([R] / "to be confirmed against encoding_k3") are marked `[R]` below;
the golden test of docs/chat.md §2 (ids from the checkpoint's own encoder) is the final word on them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from ..tokenizer import Tokenizer
from .base import _ROLES, ChatError, message_parts, message_text


THINKING_EFFORTS = ("low", "medium", "high", "max")
# docs/chat.md §3.2 item 2: the llama.cpp port defaults to `max` (so the message is always present in thinking mode) and
# the worked example of §3.8 shows `thinking_effort=max` for a request that sets no effort. [R] encoding_k3 default.
DEFAULT_THINKING_EFFORT = "max"

# K3 marker names (docs/chat.md §1.3). Resolved through the loaded tokenizer, never hard-coded as ids.
OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"

# Bodies of the internal system messages. docs/chat.md §3.2 gives their structure; the exact sentences are those of the
# llama.cpp Jinja port of encoding_k3 (the only public transcription). [R] confirm against encoding_k3.
TOOL_DECLARE_PREAMBLE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
DYNAMIC_TOOL_DECLARE_PREAMBLE = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n"
)
FENCE_CLOSE = "\n```"
THINKING_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
TOOL_CHOICE_BODIES = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON_SENTENCE = (
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
)
RESPONSE_FORMAT_JSON_OBJECT_BODY = f"The system is invoked with `response_format=json_object`.\n{_RAW_JSON_SENTENCE}"
RESPONSE_FORMAT_JSON_SCHEMA_BODY = (
    f"The system is invoked with `response_format=json_schema`.\n{_RAW_JSON_SENTENCE}\n"
    "The JSON data must match the following schema:\n```json\n{schema}\n```"
)


def escape_attr(value: Any) -> str:
    """XTML attribute escaping (docs/chat.md §3.1): `&` first, then `"`."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    """Inverse of escape_attr, in the opposite order (`&quot;` first, then `&amp;`)."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def sorted_json(value: Any) -> str:
    """Tool declarations and response schemas (docs/chat.md §3.2): keys sorted at every level, arrays in given order,
    ensure_ascii=False, compact separators. [R] confirm against encoding_k3 (Python's code-point key order)."""
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ChatError(f"not JSON-serialisable: {exc}") from None


def xtml_type(value: Any) -> str:
    """`type` attribute of an `argument` element (docs/chat.md §3.3)."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # before number: bool is an int in Python
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise ChatError(f"tool call argument value of type {type(value).__name__} is not a JSON value")


def xtml_value(value: Any) -> str:
    """`string` values are written raw; every other type as JSON with ensure_ascii=False (docs/chat.md §3.3).

    docs/chat.md does not fix the separators of non-string values; Python's json.dumps defaults (`", "`, `": "`) and the
    object's own key order are used, as a Python encoder calling json.dumps(value, ensure_ascii=False) writes them.
    [R] confirm against encoding_k3.
    """
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ChatError(f"tool call argument is not JSON-serialisable: {exc}") from None


def _function_of(call: Any) -> Mapping:
    """OpenAI `{"id", "type", "function": {...}}` or a bare `{"name", "arguments"}`."""
    if not isinstance(call, Mapping):
        raise ChatError(f"tool calls must be objects, got {type(call).__name__}")
    fn = call.get("function")
    return fn if isinstance(fn, Mapping) else call


def _call_name(call: Any) -> str:
    name = _function_of(call).get("name")
    if not isinstance(name, str) or not name:
        raise ChatError(f"a tool call needs a function name: {call!r}"[:200])
    return name


# ---------------------------------------------------------------------------------------------- id builder (K3)
class _Ids:
    """Token ids built segment by segment: specials by name, text with specials disallowed.

    Text is buffered and encoded as one piece when the next special (or the end) arrives, so adjacent text
    segments get the BPE boundaries of their concatenation.
    """

    def __init__(self, tok: Tokenizer):
        self.tok, self._ids, self._pending = tok, [], []

    def _flush(self) -> None:
        if self._pending:
            text = "".join(self._pending)
            self._pending = []
            if text:
                self._ids.extend(self.tok.encode(text, allow_special=False))

    def special(self, name: str) -> "_Ids":
        tid = self.tok.token_to_id(name)
        if tid is None or not self.tok.is_special(tid):
            raise ChatError(f"the tokenizer has no special token {name}")
        self._flush()
        self._ids.append(tid)
        return self

    def raw(self, ids: list[int]) -> "_Ids":
        """Ids given as they are (an image's media run)."""
        self._flush()
        self._ids.extend(ids)
        return self

    def text(self, s: str) -> "_Ids":
        if s:
            self._pending.append(s)
        return self

    def open(self, name: str, attrs: list[tuple[str, Any]] | None = None) -> "_Ids":
        header = name + "".join(f' {key}="{escape_attr(value)}"' for key, value in attrs or [])
        return self.special(OPEN).text(header).special(SEP)

    def close(self, name: str) -> "_Ids":
        return self.special(CLOSE).text(name).special(SEP)

    def end_message(self) -> "_Ids":
        return self.close("message").special(END_OF_MSG)

    @property
    def ids(self) -> list[int]:
        self._flush()
        return self._ids


# ---------------------------------------------------------------------------------------- tool-result reordering
def normalize_k3_messages(messages: list[Mapping]) -> list[dict]:
    """Map roles (developer -> system) and resolve tool results (docs/chat.md §3.2 item 3).

    Each maximal run of consecutive `tool` messages is matched against the tool_calls of the most recent assistant
    message, by `tool_call_id` (or the message's `id`) equal to a call's `id` or to the alias
    `"{name}:{0-based position}"`. If every result of the run resolves, the run is sorted by call position (stable
    for duplicates) and each gets `tool` = the call's function name and `index` = position + 1. Otherwise the run
    keeps its order, `index` is the 1-based position in the run and the name comes from the message's `tool` /
    `name` field or, failing that, from the call at the same position. Returns new dicts; the input is untouched.
    """
    out: list[dict] = []
    calls: list = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if not isinstance(m, Mapping):
            raise ChatError(f"messages must be objects, got {type(m).__name__}")
        role = _ROLES.get(m.get("role"))
        if role is None:
            raise ChatError(f"unsupported message role {m.get('role')!r}")
        if role != "tool":
            if role == "assistant":
                tc = m.get("tool_calls")
                if tc is not None and not isinstance(tc, list):
                    raise ChatError("assistant tool_calls must be a list")
                calls = tc or []
            out.append({**m, "role": role})
            i += 1
            continue
        end = i
        while end < len(messages) and isinstance(messages[end], Mapping) and messages[end].get("role") == "tool":
            end += 1
        run = [dict(x) for x in messages[i:end]]
        i = end
        targets: dict[str, tuple[int, str]] = {}
        for position, call in enumerate(calls):
            name = _call_name(call)
            aliases = [f"{name}:{position}"]
            if isinstance(call, Mapping) and call.get("id") is not None:
                aliases.insert(0, str(call["id"]))
            for alias in aliases:
                targets.setdefault(alias, (position, name))
        resolved = []
        for order, msg in enumerate(run):
            key = msg.get("tool_call_id", msg.get("id"))
            target = targets.get(str(key)) if key is not None else None
            if target is None:
                break
            resolved.append((target[0], order, {**msg, "role": "tool", "tool": target[1], "index": target[0] + 1}))
        if len(resolved) == len(run):
            resolved.sort(key=lambda item: (item[0], item[1]))
            out.extend(item[2] for item in resolved)
            continue
        for position, msg in enumerate(run):
            name = msg.get("tool") or msg.get("name")
            if not name and position < len(calls):
                name = _call_name(calls[position])
            if not name:
                raise ChatError(f"tool message {i - len(run) + position} has no resolvable tool name: give it a "
                                "tool_call_id matching a preceding assistant tool call, or a `name`")
            out.append({**msg, "role": "tool", "tool": name, "index": position + 1})
    return out


# ------------------------------------------------------------------------------------------------- K3 renderer
def _internal_system(out: _Ids, kind: str, body: str) -> None:
    out.open("message", [("role", "system"), ("type", kind)]).text(body).end_message()


def _tool_declare(out: _Ids, tools: Any, dynamic: bool = False) -> None:
    if not isinstance(tools, list):
        raise ChatError(f"tools must be a list, got {type(tools).__name__}")
    preamble = DYNAMIC_TOOL_DECLARE_PREAMBLE if dynamic else TOOL_DECLARE_PREAMBLE
    _internal_system(out, "tool-declare", preamble + sorted_json(tools) + FENCE_CLOSE)


def _tool_calls(out: _Ids, tool_calls: list) -> None:
    out.open("tools")
    for index, call in enumerate(tool_calls, start=1):
        fn = _function_of(call)
        out.open("call", [("tool", _call_name(call)), ("index", index)])
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            # OpenAI clients send a JSON string: parse it so history renders as `argument` elements (docs/chat.md §3.3).
            # An empty string is taken as no arguments (llama.cpp port: `arguments|trim` is false). Only a string
            # that is not a JSON object falls back to one raw `json` element.
            if not arguments.strip():
                arguments = {}
            else:
                try:
                    parsed = json.loads(arguments)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    arguments = parsed
                else:
                    out.open("json", [("type", "object")]).text(arguments).close("json").close("call")
                    continue
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            raise ChatError(f"tool call arguments must be an object or a JSON string, got "
                            f"{type(arguments).__name__}")
        for key, value in arguments.items():
            out.open("argument", [("key", key), ("type", xtml_type(value))])
            out.text(xtml_value(value)).close("argument")
        out.close("call")
    out.close("tools")


def _response_schema(response_format: Mapping) -> Any:
    wrapper = response_format.get("json_schema")
    if not isinstance(wrapper, Mapping) or "schema" not in wrapper:
        raise ChatError("response_format json_schema needs json_schema.schema")
    return wrapper["schema"]


def render_k3(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True, thinking: bool = True,
              tools: list[dict] | None = None, tool_choice: Any = None, response_format: Any = None,
              thinking_effort: str | None = None, continue_final_message: bool = False,
              image_ids: Callable[[Mapping], list[int]] | None = None) -> list[int]:
    """Token ids of a K3 XTML prompt (docs/chat.md §3.2–3.3).

    An image part of a user message becomes the ids `image_ids` gives for it (its media run, docs/vision.md §6), in
    place; without `image_ids` an image part is a ChatError.

    With `continue_final_message` (the last message must be an assistant message, `add_generation_prompt` false)
    the prompt ends right after that message's response text: its closing markers, tool calls and everything the
    format places after the conversation (tool_choice and response_format messages) are left out, as cutting the
    full rendering after the final content would leave them out.
    """
    if continue_final_message:
        if add_generation_prompt:
            raise ChatError("continue_final_message and add_generation_prompt cannot both be true")
        last = messages[-1] if messages else None
        if not isinstance(last, Mapping) or _ROLES.get(last.get("role")) != "assistant":
            raise ChatError("continue_final_message requires the last message to be an assistant message")
    if thinking and thinking_effort is None:
        thinking_effort = DEFAULT_THINKING_EFFORT
    if thinking and thinking_effort not in THINKING_EFFORTS:
        raise ChatError(f"unsupported thinking_effort {thinking_effort!r}; supported: {', '.join(THINKING_EFFORTS)}")
    out = _Ids(tok)
    # 1. tool declaration
    if tools:
        _tool_declare(out, tools)
    # 2. thinking effort
    if thinking:
        _internal_system(out, "thinking-effort", THINKING_EFFORT_BODY.format(effort=thinking_effort))
    # 3. conversation
    conversation = normalize_k3_messages(messages)
    for position, m in enumerate(conversation, start=1):
        role = m["role"]
        if role == "system" and m.get("tools"):
            # A system message carrying its own tools is a dynamic tool declaration; its content is not rendered
            # (llama.cpp port behaviour).
            _tool_declare(out, m["tools"], dynamic=True)
            continue
        if role == "tool":
            out.open("message", [("role", "tool"), ("tool", m["tool"]), ("index", m["index"])])
            out.text(message_text(m)).end_message()
            continue
        attrs: list[tuple[str, Any]] = [("role", role)]
        if m.get("name"):
            attrs.append(("name", m["name"]))
        out.open("message", attrs)
        if role == "assistant":
            if thinking:
                reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
                if not isinstance(reasoning, str):
                    raise ChatError("assistant reasoning_content must be a string")
                out.open("think")
                # "reasoning text if non-empty": whitespace-only reasoning is dropped like the llama.cpp port does.
                if reasoning.strip():
                    out.text(reasoning)
                out.close("think")
            out.open("response").text(message_text(m))
            if continue_final_message and position == len(conversation):
                return out.ids
            out.close("response")  # present even when empty
            if m.get("tool_calls"):  # an empty list is dropped
                _tool_calls(out, m["tool_calls"])
        else:
            for piece in message_parts(m):
                if isinstance(piece, str):
                    out.text(piece)
                elif image_ids is None:
                    raise ChatError("the conversation holds an image: this model takes no images")
                else:
                    out.raw(image_ids(piece))
        out.end_message()
    # 4. tool_choice
    if tool_choice is not None and tool_choice != "auto":
        if isinstance(tool_choice, str):
            if tool_choice not in TOOL_CHOICE_BODIES:
                raise ChatError(f"unsupported tool_choice {tool_choice!r}; expected auto, required, none or "
                                "a named function")
            _internal_system(out, "tool-choice", TOOL_CHOICE_BODIES[tool_choice])
        elif isinstance(tool_choice, Mapping):
            # A named choice {"type": "function", "function": {"name": ...}}: its rendering is defined only by
            # encoding_k3 [R]; vLLM enforces it with constrained decoding. Nothing is rendered here.
            fn = tool_choice.get("function")
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise ChatError("a named tool_choice needs function.name")
        else:
            raise ChatError(f"tool_choice must be a string or an object, got {type(tool_choice).__name__}")
    # 5. response_format
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, Mapping) else response_format
        if kind == "json_object":
            _internal_system(out, "response-format", RESPONSE_FORMAT_JSON_OBJECT_BODY)
        elif kind == "json_schema":
            if not isinstance(response_format, Mapping):
                raise ChatError("response_format json_schema needs json_schema.schema")
            schema = sorted_json(_response_schema(response_format))
            _internal_system(out, "response-format", RESPONSE_FORMAT_JSON_SCHEMA_BODY.format(schema=schema))
        elif kind != "text":
            raise ChatError(f"unsupported response_format type {kind!r}; expected text, json_object or json_schema")
    # 6. generation prompt (deltaserve reports the full prompt, channel opener included, as prompt_tokens)
    if add_generation_prompt:
        out.open("message", [("role", "assistant")]).open("think" if thinking else "response")
    return out.ids
