"""Structured outputs of chat completions: the constraint of a request placed inside its model's output format
(docs/serving.md §10 "Structured outputs").

A chat model does not write bare JSON: a K3 reply is reasoning, then a response channel, then an optional tools
channel, in XTML markers (docs/chat.md §3.4); a Kimi-Linear / K2 reply is reasoning up to `</think>`, content, then a
tool-call section (docs/chat.md §4). So a `response_format` or `structured_outputs` constraint applies to the
content, and `tool_choice: "required"` or a named tool to the tool calls, each written as a Lark grammar over the
family's special tokens around llguidance sub-grammars (`@body`, `@args_K`: the constraint, each tool's parameter
schema). Reasoning stays free text. The result is one llguidance grammar for the whole output, which the engine
enforces token by token (engine/grammar.py).

Forced calls leave no content beside them (as vLLM's "required" answers with calls only) and carry their arguments
as JSON valid against the tool's `parameters` schema: on K3 in the call's `json` element (the parser passes it
through verbatim, docs/chat.md §3.5), on K2 as the call's argument JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..config import ModelConfig
from ..engine.grammar import named_grammars
from ..engine.sampling_params import InvalidRequestError, StructuredOutputsParams
from ..tokenizer import Tokenizer

TEXT = "TEXT: /(?s:.+)/"  # free text: any bytes up to the next special token

_K3_MARKERS = ("<|open|>", "<|close|>", "<|sep|>")
_K2_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>")


@dataclass
class ToolForcing:
    """`tool_choice` that forces calls: `tools` (OpenAI function dicts) the calls may use — the one named tool, or
    all of them for "required" — and whether more than one call may follow."""

    tools: list[dict]
    many: bool


def forcing(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool) -> ToolForcing | None:
    """The ToolForcing of a request's `tools` / `tool_choice` (a mode string or {"function": {"name"}}), or None."""
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return ToolForcing(tools, parallel_tool_calls)
    name = tool_choice["function"]["name"]
    return ToolForcing([t for t in tools if t["function"]["name"] == name], many=False)


def chat_output_grammar(config: ModelConfig, tokenizer: Tokenizer, thinking: bool,
                        body: StructuredOutputsParams | None, tools: ToolForcing | None,
                        field: str) -> StructuredOutputsParams:
    """The whole-output constraint of a chat request whose content follows `body` or whose calls follow `tools`
    (exactly one of them); `thinking` says whether the output starts in the reasoning channel. Raises
    InvalidRequestError(field) when the model's format has no place for it."""
    family = config.family
    if family == "kimi_k3":
        _require_specials(tokenizer, _K3_MARKERS, field)
        lark = _k3(thinking, body is not None, tools)
    elif family == "kimi_linear":
        think = thinking and tokenizer.token_to_id("</think>") is not None
        if tools is not None:
            _require_specials(tokenizer, _K2_MARKERS, field)
        lark = _k2(think, body is not None, tools)
    else:
        if tools is not None:
            raise InvalidRequestError(field, f"this model's output format ({family}) has no tool calls to force")
        lark = "start: @body"
    grammars = [{"lark_grammar": lark}]
    if body is not None:
        grammars += named_grammars(body, "body")
    for k, tool in enumerate(tools.tools if tools else []):
        schema = tool["function"].get("parameters") or {"type": "object"}
        grammars += named_grammars(StructuredOutputsParams(json=schema), f"args_{k}")
    return StructuredOutputsParams(grammar=json.dumps({"grammars": grammars}))


def _require_specials(tokenizer: Tokenizer, names: tuple[str, ...], field: str) -> None:
    missing = [n for n in names if tokenizer.token_to_id(n) is None or not tokenizer.is_special(tokenizer.token_to_id(n))]
    if missing:
        raise InvalidRequestError(field, f"this model's tokenizer lacks the special tokens {missing} of its chat "
                                         f"format, so {field} cannot be enforced")


def _lit(text: str) -> str:
    return json.dumps(text)


def _k3(thinking: bool, content: bool, tools: ToolForcing | None) -> str:
    """K3 XTML: [REASONING <|close|>think<|sep|>] <|open|>response<|sep|> CONTENT <|close|>response<|sep|>
    [<|open|>tools<|sep|> CALLS <|close|>tools<|sep|>] <|close|>message<|sep|>; with thinking off the prompt has
    opened the response channel already."""
    head = f"(TEXT? <|close|> {_lit('think')} <|sep|>)? <|open|> {_lit('response')} <|sep|> " if thinking else ""
    tail = f"<|close|> {_lit('response')} <|sep|>"
    close_message = f"<|close|> {_lit('message')} <|sep|>"
    if content:
        return f"start: {head}@body {tail} {close_message}\n{TEXT}"
    rules = [_k3_call(k, tool["function"]["name"]) for k, tool in enumerate(tools.tools)]
    return (f"start: {head}{tail} <|open|> {_lit('tools')} <|sep|> calls <|close|> {_lit('tools')} <|sep|> "
            f"{close_message}\n{_calls(len(rules), tools.many)}\n" + "\n".join(rules) + f"\n{TEXT}")


def _k3_call(k: int, name: str) -> str:
    """`<|open|>call tool="NAME" index="I"<|sep|><|open|>json type="object"<|sep|>ARGS<|close|>json<|sep|>
    <|close|>call<|sep|>`, the name escaped as the renderer escapes attribute values."""
    header = 'call tool="' + name.replace("&", "&amp;").replace('"', "&quot;") + '" index="'
    return (f"call_{k}: <|open|> {_lit(header)} /[1-9][0-9]*/ {_lit(chr(34))} <|sep|> "
            f"<|open|> {_lit('json type=' + chr(34) + 'object' + chr(34))} <|sep|> @args_{k} "
            f"<|close|> {_lit('json')} <|sep|> <|close|> {_lit('call')} <|sep|>")


def _calls(count: int, many: bool) -> str:
    """`calls`: one call (or, with `many`, one or more), each of the rules call_0 .. call_{count-1}."""
    return f"calls: call{' call*' if many else ''}\ncall: " + " | ".join(f"call_{k}" for k in range(count))


def _k2(thinking: bool, content: bool, tools: ToolForcing | None) -> str:
    """K2 / Kimi-Linear: [<think>] [REASONING </think>] CONTENT [<|tool_calls_section_begin|> CALLS
    <|tool_calls_section_end|>]."""
    head = "<think>? TEXT? </think> " if thinking else ""
    if content:
        return f"start: {head}@body\n{TEXT}"
    rules = [f"call_{k}: <|tool_call_begin|> {_lit('functions.' + tool['function']['name'] + ':')} /[0-9]+/ "
             f"<|tool_call_argument_begin|> @args_{k} <|tool_call_end|>" for k, tool in enumerate(tools.tools)]
    return (f"start: {head}<|tool_calls_section_begin|> calls <|tool_calls_section_end|>\n"
            f"{_calls(len(rules), tools.many)}\n" + "\n".join(rules) + f"\n{TEXT}")
