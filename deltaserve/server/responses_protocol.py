"""The request of POST /v1/responses (OpenAI's Responses API) and its translation into the chat path's terms
(docs/serving.md §10, "The Responses API").

The request is validated as strictly as the other endpoints (the body is walked for values the engine cannot carry
first, types are strict, every request that parses builds a valid `SamplingParams`) and, unlike them, refuses
fields it does not know: a Responses client that sends a field deltaserve does not implement gets a 400 naming it
instead of a response that silently ignored it.

deltaserve keeps no conversation state, so `store` may only be false and `previous_response_id` and
`item_reference` inputs are refused; the client sends the whole conversation as `input` every turn, including the
`reasoning`, `function_call` and `function_call_output` items of earlier turns.

Translation (`ResponsesRequest.chat_prompt`): `instructions` becomes a leading system message; `input` text one user
message; input items become chat messages — a message item keeps its role, its text parts joined; each run of
assistant-side items (`reasoning`, an assistant `message`, `function_call`s, in the order a model writes them)
becomes one assistant message with `reasoning_content`, `content` and `tool_calls`; a `function_call_output` becomes
a `tool` message answering its call. Function tools, `tool_choice`, `text.format` and `reasoning.effort` become the
chat request's `tools`, `tool_choice`, `response_format` and `reasoning_effort`, rendered by the same renderer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from ..engine.sampling_params import InvalidRequestError, SamplingParams
from .protocol import (ChatPromptOptions, ChatTool, Float, FunctionDefinition, JsonSchema, JsonSchemaFormat,
                       NamedFunction, NamedToolChoice, ReasoningEffort, RequestBody, ResponseFormat,
                       check_chat_options, request_error)

# OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class _Strict(BaseModel):
    """A part of the request that refuses fields it does not define."""

    model_config = ConfigDict(extra="forbid")


def _unsupported(message: str) -> PydanticCustomError:
    """A validation error for a value deltaserve cannot honour; the error's path names the field."""
    return PydanticCustomError("unsupported_value", message)


def _tagged(*tags: str, note: str = ""):
    """A discriminator on an object's `type` (the first tag when it has none), with tags in brackets so that error
    paths name the field (`input.0.content.1`), not the union member."""
    def tag(value: Any) -> str | None:
        kind = value.get("type", tags[0]) if isinstance(value, dict) else getattr(value, "type", None)
        return f"[{kind}]" if kind in tags else None
    return Discriminator(tag, custom_error_type="invalid_item_type",
                         custom_error_message=f"type must be one of {', '.join(map(repr, tags))}{note}")


def _text_or(items: Any) -> Any:
    """A string or a list of `items`, told apart by the value's kind, so that an error inside the list names the
    entry rather than the string alternative."""
    return Annotated[Union[Annotated[StrictStr, Tag("[text]")], Annotated[items, Tag("[list]")]],
                     Discriminator(lambda value: "[text]" if isinstance(value, str) else "[list]")]


# ---------------------------------------------------------------------------------------------------- input items
class InputText(_Strict):
    type: Literal["input_text"]
    text: StrictStr


class OutputText(_Strict):
    """An `output_text` part as a previous response returned it; its annotations and logprobs are not rendered."""

    type: Literal["output_text"]
    text: StrictStr
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


TextPart = Annotated[Union[Annotated[InputText, Tag("[input_text]")], Annotated[OutputText, Tag("[output_text]")]],
                     _tagged("input_text", "output_text", note=" (images, files and audio are not supported)")]
MessageContent = _text_or(list[TextPart])
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def _joined(content: str | list[InputText | OutputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(_Strict):
    """A message: `{"role", "content"}` (the easy form) or a message item with `type`, `id`, `status`."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: MessageContent
    id: StrictStr | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: StrictStr


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: StrictStr


class ReasoningItem(_Strict):
    """Reasoning of an earlier turn: its `content` text is rendered as that turn's reasoning (a summary is not)."""

    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: StrictStr | None = None
    status: ItemStatus | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _no_encrypted(cls, value):
        if value is not None:
            raise _unsupported("deltaserve neither writes nor reads encrypted reasoning: send the reasoning text as "
                               "content and encrypted_content null")
        return value


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: ItemStatus | None = None


CallOutput = _text_or(list[InputText])


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: CallOutput
    name: StrictStr | None = None
    id: StrictStr | None = None
    status: ItemStatus | None = None


class ItemReference(_Strict):
    type: Literal["item_reference"]
    id: StrictStr


InputItem = Annotated[Union[Annotated[MessageItem, Tag("[message]")], Annotated[ReasoningItem, Tag("[reasoning]")],
                            Annotated[FunctionCallItem, Tag("[function_call]")],
                            Annotated[FunctionCallOutputItem, Tag("[function_call_output]")],
                            Annotated[ItemReference, Tag("[item_reference]")]],
                      _tagged("message", "reasoning", "function_call", "function_call_output", "item_reference")]



# A string is one user message.
Input = _text_or(list[InputItem])


# --------------------------------------------------------------------------------------------- tools and options
class FunctionTool(_Strict):
    """A function tool in the Responses API's flat shape (the chat API nests the same fields under `function`)."""

    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: JsonSchema | None = None
    strict: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _not_chat_shaped(cls, data: Any) -> Any:
        if isinstance(data, dict) and "function" in data:
            raise _unsupported("a Responses tool is flat ({\"type\": \"function\", \"name\", \"parameters\", ...}); "
                               "the nested {\"function\": {...}} form belongs to chat completions")
        return data


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: StrictStr


def _choice_tag(value: Any) -> str:
    return "[mode]" if isinstance(value, str) else "[function]"


ToolChoice = Annotated[Union[Annotated[Literal["none", "auto", "required"], Tag("[mode]")],
                             Annotated[FunctionChoice, Tag("[function]")]], Discriminator(_choice_tag)]


class PlainTextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaTextFormat(_Strict):
    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)
    type: Literal["json_schema"]
    name: StrictStr
    schema_: JsonSchema = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


TextFormat = Annotated[Union[Annotated[PlainTextFormat, Tag("[text]")],
                             Annotated[JsonObjectFormat, Tag("[json_object]")],
                             Annotated[JsonSchemaTextFormat, Tag("[json_schema]")]],
                       _tagged("text", "json_object", "json_schema")]


class TextConfig(_Strict):
    format: TextFormat = Field(default_factory=lambda: PlainTextFormat(type="text"))


class ReasoningConfig(_Strict):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None

    @field_validator("summary")
    @classmethod
    def _no_summary(cls, value):
        if value is not None:
            raise _unsupported("deltaserve writes no reasoning summaries (the reasoning item carries the reasoning "
                               "text itself): leave reasoning.summary out")
        return value


@dataclass
class ChatPrompt(ChatPromptOptions):
    """A Responses request in the chat request's terms, rendered by `ServerState.render` as a chat is."""

    messages: list[dict]
    tools: list[ChatTool] | None
    tool_choice: str | NamedToolChoice | None
    response_format: ResponseFormat | None
    reasoning_effort: str | None
    chat_template_kwargs: None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


# ------------------------------------------------------------------------------------------------------ request
class ResponsesRequest(RequestBody):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    input: Input
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0)] | None = None
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    seed: Annotated[StrictInt, Field(ge=-(2 ** 63), le=2 ** 64 - 1)] | None = None
    reasoning: ReasoningConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = True
    text: TextConfig | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    stream: StrictBool | None = False

    @field_validator("store")
    @classmethod
    def _no_store(cls, value):
        if value:
            raise request_error("store", "deltaserve keeps no responses: store must be false or absent")
        return value

    @field_validator("previous_response_id")
    @classmethod
    def _no_previous_response(cls, value):
        if value is not None:
            raise request_error("previous_response_id", "deltaserve keeps no conversation state, so there is no "
                                "previous response to continue: send the whole conversation as `input` (earlier "
                                "output items included) and leave previous_response_id out")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value):
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise request_error("metadata", f"metadata holds at most {MAX_METADATA_PAIRS} pairs, got {len(value)}")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY:
                raise request_error("metadata", f"metadata keys are at most {MAX_METADATA_KEY} characters")
            if len(text) > MAX_METADATA_VALUE:
                raise request_error(f"metadata.{key}", f"metadata values are at most {MAX_METADATA_VALUE} characters")
        return value

    @model_validator(mode="after")
    def _check_request(self):
        self.chat_prompt()
        try:
            self.to_sampling_params()
        except InvalidRequestError as exc:
            raise request_error(exc.field, str(exc)) from None
        return self

    # -- the chat path's terms -------------------------------------------------------------------------------------
    def to_sampling_params(self) -> SamplingParams:
        """One completion; unset temperature / top_p take the neutral 1.0 and an unset max_output_tokens lets the
        output run to the end of the context, as chat completions does. Raises InvalidRequestError naming the
        request's field."""
        try:
            return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                                  top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
                                  max_tokens=self.max_output_tokens)
        except InvalidRequestError as exc:
            if exc.field != "max_tokens":
                raise
            raise InvalidRequestError("max_output_tokens", str(exc).replace("max_tokens", "max_output_tokens")) \
                from None

    def chat_prompt(self) -> ChatPrompt:
        """The request as a chat (module docstring); raises a request error naming the offending input."""
        tools = [ChatTool(function=FunctionDefinition(name=t.name, description=t.description,
                                                      parameters=t.parameters, strict=t.strict))
                 for t in self.tools] if self.tools else None
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(function=NamedFunction(name=choice.name))
        fmt = self.text.format if self.text is not None else None
        response_format = None
        if isinstance(fmt, JsonSchemaTextFormat):
            response_format = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
                name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))
        elif fmt is not None:
            response_format = ResponseFormat(type=fmt.type)
        check_chat_options(tools, choice, response_format)
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += input_messages(self.input)
        if not messages:
            raise request_error("input", "the conversation is empty: give input (or instructions)")
        effort = self.reasoning.effort if self.reasoning is not None else None
        return ChatPrompt(messages, tools, choice, response_format, effort)


def _opens_turn(turn: dict | None, item: Any) -> bool:
    """Whether an assistant-side item starts a new assistant message: a model writes a turn as reasoning, then
    text, then calls, so an item that cannot follow what the current turn holds begins the next turn."""
    if turn is None:
        return True
    if isinstance(item, ReasoningItem):
        return bool(turn.get("reasoning_content") or turn["content"] or turn.get("tool_calls"))
    if isinstance(item, MessageItem):
        return bool(turn["content"] or turn.get("tool_calls"))
    return False


def input_messages(items: str | list) -> list[dict]:
    """`input` as chat messages (module docstring). Raises a request error naming the item that cannot be
    translated: an item reference, or a function_call_output whose call is not in the input."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    turn: dict | None = None  # the assistant message the current run of assistant-side items builds
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, ItemReference):
            raise request_error(f"input.{i}", "deltaserve keeps no items, so an item_reference cannot be resolved: "
                                "send the item itself")
        if isinstance(item, FunctionCallOutputItem):
            if item.call_id not in call_ids:
                raise request_error(f"input.{i}.call_id", f"no function_call item with call_id {item.call_id!r} "
                                    "precedes this output in input (deltaserve keeps no state: send the call too)")
            tool = {"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)}
            messages.append(tool if item.name is None else {**tool, "name": item.name})
            turn = None
            continue
        if isinstance(item, MessageItem) and item.role != "assistant":
            messages.append({"role": item.role, "content": _joined(item.content)})
            turn = None
            continue
        if _opens_turn(turn, item):
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        if isinstance(item, ReasoningItem):
            turn["reasoning_content"] = "".join(part.text for part in item.content or ())
        elif isinstance(item, MessageItem):
            turn["content"] = _joined(item.content)
        else:
            call_ids.add(item.call_id)
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
    return messages
