"""OpenAI-compatible request / response models (docs/serving.md §10), with vLLM's field names and defaults.

Requests ignore unknown fields (as OpenAI and vLLM do) but reject wrong types and out-of-range values at parse time:
numbers, ints and bools are strict (`"0.5"`, `true` or `5.0` are not accepted where a float / int / bool is expected;
vLLM is laxer).
Before any field is read, the whole body (known and unknown fields, dict keys, message content parts, tool
definitions) is walked once: every string must be valid UTF-8, every integer inside what msgpack carries and every
float finite (`engine.representable`), so nothing that parses can fail on its way to the engine; the error names the
value's path, e.g. `stop.0` or `messages.1.content`. Tool parameter schemas and `response_format.json_schema.schema`
must be valid JSON schemas (checked against their meta-schema).
Every request that parses also builds a valid `SamplingParams`, so the engine's own checks (e.g. `min_tokens` above
`max_tokens`, an empty stop string) surface as parse errors too. Cross-field checks raise a pydantic error of type
`invalid_request` whose `ctx["param"]` names the offending field; `validation_error_body` turns any validation error
into vLLM's error body: `{"error": {"message", "type": "BadRequestError", "param", "code": 400}}`.

Choices worth knowing:
* Sampling fields default to None = "server default": `to_sampling_params(default_max_tokens, defaults=...)` fills them
  from `defaults` (e.g. a generation config), then from vLLM's neutral values (temperature 1.0, top_p 1.0, top_k off,
  min_p 0, penalties 0 / 0 / 1.0).
* Max tokens: the request's value (chat: `max_completion_tokens`, else the deprecated `max_tokens`) is used as given;
  when absent, the smaller of `default_max_tokens` (the server passes max_model_len - prompt length) and
  `defaults["max_tokens"]`. Checking prompt + max_tokens against max_model_len is the server's job.
* Chat `top_logprobs > 0` requires `logprobs: true`; `top_logprobs: 0` without logprobs is accepted (harmless).
* `tool_choice` other than "none" requires `tools`; a named choice must name one of the tools. Unset, it resolves to
  "auto" with tools and "none" without (`effective_tool_choice`).
* `suffix`, `prompt_logprobs`, non-empty `logit_bias`, and `best_of != n` are rejected as unsupported.
* Chat `messages` are validated per message (errors name e.g. `messages.0.role`) and then held as plain dicts (explicit
  nulls dropped, unknown keys such as `reasoning` kept), the form `chat.render_chat` takes.
* `reasoning_effort`: "none" disables thinking; other values set the thinking effort ("minimal" -> "low",
  "xhigh" -> "max"); `chat_template_kwargs.thinking` / `enable_thinking` / `thinking_effort` take precedence.
"""

import json
import time
import uuid
from typing import Annotated, Any, Literal, Mapping, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, PlainSerializer, PlainValidator,
                      StrictBool, StrictFloat, StrictInt, StrictStr, Tag, ValidationError, field_validator,
                      model_serializer, model_validator)
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from pydantic_core import PydanticCustomError

from ..engine.representable import first_unrepresentable
from ..engine.sampling_params import MAX_LOGPROBS, InvalidRequestError, SamplingParams, StructuredOutputsParams

BAD_REQUEST_TYPE = "BadRequestError"

Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0)]
Penalty = Annotated[Float, Field(ge=-2, le=2)]
LogprobCount = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]
Json = dict[str, Any]


def random_uuid() -> str:
    return uuid.uuid4().hex


def request_error(param: str | None, message: str) -> PydanticCustomError:
    """A validation error (type `invalid_request`) that names `param`; raise it from a validator."""
    return PydanticCustomError("invalid_request", "{message}", {"message": message, "param": param})


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestBody(OpenAIModel):
    """A request's top-level model: the raw body is checked for values the engine cannot represent first."""

    @model_validator(mode="before")
    @classmethod
    def _representable(cls, data: Any) -> Any:
        bad = first_unrepresentable(data)
        if bad is not None:
            path, reason = bad
            raise request_error(path or None, f"{path or 'request body'}: {reason}")
        return data


def _check_json_schema(schema: Json | None) -> Json | None:
    """A JSON schema that its meta-schema accepts (the draft its `$schema` names, else the latest)."""
    if schema is None:
        return None
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise PydanticCustomError("invalid_json_schema", "not a valid JSON schema: {reason}",
                                  {"reason": exc.message}) from None
    except RecursionError:
        raise PydanticCustomError("invalid_json_schema", "the JSON schema is nested too deeply") from None
    return schema


JsonSchema = Annotated[Json, AfterValidator(_check_json_schema)]


# ---------------------------------------------------------------------------------------------------------------------
# Request pieces


class StreamOptions(OpenAIModel):
    include_usage: StrictBool | None = True
    continuous_usage_stats: StrictBool | None = False


class FunctionCallParam(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    arguments: StrictStr | Json = "{}"


class ToolCallParam(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(OpenAIModel):
    """One input message; unknown keys (e.g. `reasoning`, a system message's `tools`) are kept."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[Json] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None


# A message is validated as ChatMessageParam (so errors name e.g. `messages.0.role`) and then kept as a plain dict
# (explicit nulls dropped, unknown keys kept), the form the chat renderer takes.
MessageDict = Annotated[ChatMessageParam, AfterValidator(lambda m: m.model_dump(exclude_none=True)),
                        PlainSerializer(lambda m: m, return_type=dict)]
Messages = Annotated[list[MessageDict], Field(min_length=1)]


class FunctionDefinition(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    description: StrictStr | None = None
    parameters: JsonSchema | None = None
    strict: StrictBool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: StrictStr


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


def _tool_choice_tag(value: Any) -> str:
    return "tool_choice[named]" if isinstance(value, (dict, NamedToolChoice)) else "tool_choice[mode]"


ToolChoice = Annotated[Union[Annotated[Literal["none", "auto", "required"], Tag("tool_choice[mode]")],
                             Annotated[NamedToolChoice, Tag("tool_choice[named]")]],
                       Discriminator(_tool_choice_tag)]


class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(extra="ignore", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)
    name: StrictStr = "response"
    description: StrictStr | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _schema_text(value: Json | str) -> Json:
    """A JSON schema given as an object or as its JSON text (vLLM takes both for guided_json)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise PydanticCustomError("invalid_json_schema", "not valid JSON: {reason}", {"reason": str(exc)}) from None
        if not isinstance(value, dict):
            raise PydanticCustomError("invalid_json_schema", "a JSON schema must be an object")
    return _check_json_schema(value)


SchemaOrText = Annotated[Union[Json, StrictStr], AfterValidator(_schema_text)]
Choices = Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1)]


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: SchemaOrText | None = Field(default=None, alias="json")
    regex: Annotated[StrictStr, Field(min_length=1)] | None = None
    choice: Choices | None = None
    grammar: Annotated[StrictStr, Field(min_length=1)] | None = None
    json_object: StrictBool | None = None
    structural_tag: StrictStr | None = None
    model_config = ConfigDict(extra="ignore", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    @field_validator("structural_tag")
    @classmethod
    def _no_structural_tag(cls, value):
        if value is not None:
            raise request_error("structured_outputs.structural_tag", "structural_tag is not supported; use json, "
                                "regex, choice, grammar or json_object")
        return value

    def params(self) -> StructuredOutputsParams:
        """The engine's form; that exactly one constraint is given is checked there (StructuredOutputsParams)."""
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=bool(self.json_object))


class ChatTemplateKwargs(OpenAIModel):
    """Template switches; other keys are kept and passed to the template."""

    model_config = ConfigDict(extra="allow")
    thinking: StrictBool | None = None
    enable_thinking: StrictBool | None = None
    thinking_effort: Literal["low", "medium", "high", "max"] | None = None


_EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "max", "max": "max"}
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


def _template_kwargs(kwargs: ChatTemplateKwargs | None, reasoning_effort: str | None, default_thinking: bool) -> dict:
    kwargs = kwargs or ChatTemplateKwargs()
    out = dict(kwargs.model_extra or {})
    if kwargs.thinking is not None:
        thinking = kwargs.thinking
    elif kwargs.enable_thinking is not None:
        thinking = kwargs.enable_thinking
    elif reasoning_effort is not None:
        thinking = reasoning_effort != "none"
    else:
        thinking = default_thinking
    effort = kwargs.thinking_effort or _EFFORTS.get(reasoning_effort or "")
    out.update(thinking=thinking, thinking_effort=effort if thinking else None)
    return out


def _check_messages(messages: list[dict] | None, add_generation_prompt: bool,
                    continue_final_message: bool, kwargs: ChatTemplateKwargs | None) -> None:
    if continue_final_message and add_generation_prompt:
        raise request_error("continue_final_message", "continue_final_message and add_generation_prompt cannot both "
                            "be true (set add_generation_prompt to false)")
    if continue_final_message and messages and messages[-1]["role"] != "assistant":
        raise request_error("continue_final_message", "continue_final_message requires the last message to be an "
                            f"assistant message, got role {messages[-1]['role']!r}")
    if kwargs is not None and None not in (kwargs.thinking, kwargs.enable_thinking) \
            and kwargs.thinking != kwargs.enable_thinking:
        raise request_error("chat_template_kwargs.enable_thinking",
                            "chat_template_kwargs.thinking and enable_thinking (its alias) disagree")


def response_format_constraint(rf: ResponseFormat | None, param: str) -> tuple[StructuredOutputsParams | None, str]:
    """The output constraint of a `response_format` given as the request field `param`, and the field a compile
    error names (its schema's, for json_schema); (None, "") for none or plain text."""
    if rf is None or rf.type == "text":
        return None, ""
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True), param
    return StructuredOutputsParams(json=rf.json_schema.schema_), f"{param}.json_schema.schema"


def _check_response_format(rf: ResponseFormat | None) -> None:
    if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
        raise request_error("response_format.json_schema", "response_format of type json_schema requires "
                            "json_schema.schema")


def check_chat_options(tools: list[ChatTool] | None, tool_choice: Any, response_format: ResponseFormat | None) -> None:
    if tool_choice not in (None, "none") and not tools:
        name = tool_choice if isinstance(tool_choice, str) else "a named function"
        raise request_error("tool_choice", f"tool_choice {name!r} requires tools to be set")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in {t.function.name for t in tools}:
        raise request_error("tool_choice", f"tool_choice names function {tool_choice.function.name!r}, which is not "
                            "in tools")
    _check_response_format(response_format)


class ChatPromptOptions:
    """How `messages` render into prompt ids, read the same way by chat completions and /tokenize (so a /tokenize
    count is the prompt_tokens of the same chat request). A mixin over the request fields `messages`, `tools`,
    `tool_choice`, `response_format`, `reasoning_effort`, `chat_template_kwargs`, `add_generation_prompt` and
    `continue_final_message`."""

    def template_kwargs(self, default_thinking: bool) -> dict:
        """Resolved template switches: `thinking` (bool: the request's switches, else its reasoning_effort, else
        the model's `default_thinking`), `thinking_effort` (str | None), plus any other kwargs."""
        return _template_kwargs(self.chat_template_kwargs, self.reasoning_effort, default_thinking)

    def thinking_settings(self, default_thinking: bool) -> tuple[bool, str | None]:
        """(thinking, thinking_effort) as resolved by `template_kwargs`."""
        kwargs = self.template_kwargs(default_thinking)
        return kwargs["thinking"], kwargs["thinking_effort"]

    def extra_template_kwargs(self) -> dict:
        """chat_template_kwargs other than the thinking switches (which `thinking_settings` resolves)."""
        return dict((self.chat_template_kwargs or ChatTemplateKwargs()).model_extra or {})

    def tool_dicts(self) -> list[dict] | None:
        """`tools` as plain dicts (None when absent or empty)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_choice_value(self) -> str | dict | None:
        """`tool_choice` for the renderer: None when unset or "auto" (nothing to render), else the string / object."""
        tc = self.tool_choice
        if tc is None or tc == "auto":
            return None
        return tc if isinstance(tc, str) else tc.model_dump()

    def response_format_dict(self) -> dict | None:
        """`response_format` as a plain dict (`json_schema.schema` under its JSON name), or None."""
        return self.response_format.model_dump(by_alias=True, exclude_none=True) if self.response_format else None


# ---------------------------------------------------------------------------------------------------------------------
# Requests

_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0}


class _SamplingRequest(RequestBody):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = None
    n: Annotated[StrictInt, Field(ge=1)] = 1
    temperature: Annotated[Float, Field(ge=0)] | None = None
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[Float, Field(ge=0, le=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[Float, Field(gt=0)] | None = None
    seed: Annotated[StrictInt, Field(ge=-(2 ** 63), le=2 ** 64 - 1)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    logit_bias: dict[str, Float] | None = None
    prompt_logprobs: LogprobCount | None = None
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    echo: StrictBool = False
    request_id: StrictStr | None = None
    cache_salt: StrictStr | None = None
    priority: StrictInt = 0
    kv_transfer_params: Json | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: SchemaOrText | None = None  # vLLM's older spellings of structured_outputs
    guided_regex: Annotated[StrictStr, Field(min_length=1)] | None = None
    guided_choice: Choices | None = None
    guided_grammar: Annotated[StrictStr, Field(min_length=1)] | None = None
    guided_decoding_backend: StrictStr | None = None  # accepted; llguidance serves every grammar

    def constraint(self) -> tuple[StructuredOutputsParams | None, str]:
        """The request's output constraint and the field it came from (None, "" without one); at most one of
        response_format (json_object / json_schema), structured_outputs and the guided_* fields may ask."""
        found = []
        if self.response_format is not None and self.response_format.type != "text":
            found.append(response_format_constraint(self.response_format, "response_format"))
        if self.structured_outputs is not None:
            found.append((self.structured_outputs.params(), "structured_outputs"))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((StructuredOutputsParams(**{key: getattr(self, name)}), name))
        if len(found) > 1:
            raise InvalidRequestError(found[1][1], f"{found[1][1]} and {found[0][1]} both constrain the output; send "
                                                   "one of them")
        return found[0] if found else (None, "")

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise request_error("logit_bias", "logit_bias is not supported yet; send null or {}")
        return value

    @model_validator(mode="after")
    def _check_request(self):
        if self.stream_options is not None and not self.stream:
            raise request_error("stream_options", "stream_options can only be set when stream is true")
        _check_response_format(self.response_format)
        self._check_fields()
        try:
            self.to_sampling_params(None)
        except InvalidRequestError as exc:
            raise request_error(exc.field, str(exc)) from None
        return self

    def _check_fields(self) -> None:
        """Subclass cross-field checks; raise `request_error`."""

    # Subclasses: (requested max tokens, the field it came from) and the SamplingParams.logprobs value / its field.
    def _max_tokens(self) -> tuple[int | None, str]:
        raise NotImplementedError

    def _logprobs(self) -> tuple[int | None, str]:
        raise NotImplementedError

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def to_sampling_params(self, default_max_tokens: int | None, *,
                           defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """Build the engine's SamplingParams; raises InvalidRequestError naming the request's field."""
        defaults = defaults or {}
        kwargs = {name: getattr(self, name) if getattr(self, name) is not None else defaults.get(name, neutral)
                  for name, neutral in _NEUTRAL.items()}
        max_tokens, max_field = self._max_tokens()
        if max_tokens is None:
            limits = [v for v in (default_max_tokens, defaults.get("max_tokens")) if v is not None]
            max_tokens = min(limits) if limits else None
        logprobs, logprobs_field = self._logprobs()
        fields = {"max_tokens": max_field, "logprobs": logprobs_field}
        try:
            return SamplingParams(
                n=self.n, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
                prompt_logprobs=self._prompt_logprobs(), structured_outputs=self.constraint()[0],
                skip_special_tokens=self.skip_special_tokens, kv_transfer_params=self.kv_transfer_params,
                include_stop_str_in_output=self.include_stop_str_in_output, **kwargs)
        except InvalidRequestError as exc:
            field = fields.get(exc.field, exc.field)
            message = str(exc) if field == exc.field else str(exc).replace(exc.field, field, 1)
            raise InvalidRequestError(field, message) from None


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _validate_prompt(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(x, str) for x in value) or all(_is_token(x) for x in value):
            return list(value)
        if all(isinstance(x, list) and x and all(_is_token(t) for t in x) for x in value):
            return [list(x) for x in value]
    raise request_error("prompt", "prompt must be a string, a non-empty list of strings, a non-empty list of token ids "
                        "(ints >= 0), or a non-empty list of non-empty token-id lists")


Prompt = Annotated[Union[str, list[str], list[int], list[list[int]]],
                   PlainValidator(_validate_prompt, json_schema_input_type=Union[str, list[str], list[int],
                                                                                 list[list[int]]])]


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0},
        {"prompt": "user = ", "max_tokens": 64, "response_format": {"type": "json_schema", "json_schema": {
            "name": "user", "schema": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                                       "required": ["name"]}}}}]})
    prompt: Prompt
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    logprobs: LogprobCount | None = None
    suffix: StrictStr | None = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    add_special_tokens: StrictBool = True

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value is not None:
            raise request_error("suffix", "suffix is not supported; send null")
        return value

    def _check_fields(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise request_error("best_of", f"best_of must equal n ({self.n}) or be null: deltaserve does not rank "
                                f"candidates, got best_of={self.best_of}")

    def _max_tokens(self):
        return self.max_tokens, "max_tokens"

    def _logprobs(self):
        return self.logprobs, "logprobs"

    def _prompt_logprobs(self):
        """`echo` with `logprobs` reports the prompt's tokens too (the legacy completions API), as vLLM does."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list: each entry is one text or one list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        return [p] if isinstance(p[0], int) else list(p)

    prompt_list = prompts


class ChatCompletionRequest(_SamplingRequest, ChatPromptOptions):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16}]})
    messages: Messages
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = False
    top_logprobs: LogprobCount | None = 0
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = True
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False

    def _check_fields(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise request_error("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.prompt_logprobs is not None and self.stream:
            raise request_error("prompt_logprobs", "prompt_logprobs is returned by non-streamed chat completions "
                                                   "only; send stream: false or use /v1/completions")
        check_chat_options(self.tools, self.tool_choice, self.response_format)
        _check_messages(self.messages, self.add_generation_prompt, self.continue_final_message,
                        self.chat_template_kwargs)

    def _max_tokens(self):
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def _logprobs(self):
        return (self.top_logprobs or 0) if self.logprobs else None, "top_logprobs"

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"



class TokenizeRequest(RequestBody, ChatPromptOptions):
    """POST /tokenize: exactly one of `prompt` (text, encoded as /v1/completions encodes it) or `messages` (a chat,
    rendered with the chat fields exactly as /v1/chat/completions renders it)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Messages | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = None
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self):
        if self.prompt is None and self.messages is None:
            raise request_error("prompt", "either prompt or messages is required")
        if self.prompt is not None and self.messages is not None:
            raise request_error("messages", "give either prompt or messages, not both")
        check_chat_options(self.tools, self.tool_choice, self.response_format)
        _check_messages(self.messages, self.add_generation_prompt and self.messages is not None,
                        self.continue_final_message, self.chat_template_kwargs)
        return self

    @property
    def use_special_tokens(self) -> bool:
        """`add_special_tokens`, defaulting as vLLM does: true for a prompt, false for a chat."""
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(RequestBody):
    model: StrictStr | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------------------------------------------------------------
# Responses


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class CompletionTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)

    @classmethod
    def make(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
             reasoning_tokens: int = 0) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
                   completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning_tokens))


def _drop_nulls(data: dict, keep: tuple[str, ...] = ()) -> dict:
    return {k: v for k, v in data.items() if k in keep or (v is not None and v != [])}


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(CompletionResponseChoice):
    pass


class CompletionStreamResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_nulls(handler(self), keep=("choices",))


class FunctionCall(OpenAIModel):
    name: str
    arguments: str


class ToolCall(OpenAIModel):
    id: str = Field(default_factory=lambda: f"call_{random_uuid()[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_nulls(handler(self))


class DeltaToolCall(OpenAIModel):
    """A streamed tool call; `id`, `type` and `function.name` come only in the first delta of a call."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_nulls(handler(self))


class DeltaMessage(OpenAIModel):
    """A streamed delta: only the fields that are set (non-null, non-empty) are serialised."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_nulls(handler(self))


class ChatCompletionResponseStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_nulls(handler(self), keep=("choices",))


# Characters that JSON leaves raw inside strings but that line readers split on: str.splitlines (httpx's
# aiter_lines, requests' iter_lines) breaks an event at U+0085, U+2028 and U+2029, so a generated token that
# decodes to one of them would cut the event's JSON in two on the client. Escaped, the JSON decodes the same.
_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_data(json_text: str) -> str:
    """One server-sent event carrying the JSON text `json_text`, safe for line readers that split on Unicode line
    breaks."""
    return f"data: {json_text.translate(_LINE_BREAKS)}\n\n"


def sse_event(chunk: BaseModel) -> str:
    """One server-sent event carrying `chunk` as JSON."""
    return sse_data(chunk.model_dump_json())


SSE_DONE = "data: [DONE]\n\n"


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "deltaserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict] = Field(default_factory=list)


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIModel):
    prompt: str


# ---------------------------------------------------------------------------------------------------------------------
# Errors


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


def error_body(message: str, type: str = BAD_REQUEST_TYPE, param: str | None = None,
               code: int | str | None = None) -> dict:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


def invalid_request_body(exc: InvalidRequestError) -> tuple[int, dict]:
    """(400, body) for an InvalidRequestError raised by SamplingParams / to_sampling_params."""
    return 400, error_body(str(exc), BAD_REQUEST_TYPE, exc.field, 400)


_TYPE_TAGS = {"str", "int", "float", "bool", "bytes", "none", "dict", "list"}


def _loc_part(part: Any) -> str | None:
    """A loc element as a param path part, or None for pydantic's union / function tags."""
    if isinstance(part, int):
        return str(part)
    text = str(part)
    if any(c in text for c in "[-(") or text[:1].isupper() or text in _TYPE_TAGS:
        return None
    return text


def _error_param(err: Mapping) -> str | None:
    ctx = err.get("ctx") or {}
    if err.get("type") == "invalid_request" and "param" in ctx:
        return ctx["param"]
    loc = list(err.get("loc") or ())
    if loc and loc[0] in ("body", "query", "path"):
        loc = loc[1:]
    if err.get("type") == "json_invalid":
        return None
    parts = [p for p in map(_loc_part, loc) if p is not None]
    return ".".join(parts) or None


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def validation_error_body(exc: ValidationError | Any) -> tuple[int, dict]:
    """(400, OpenAI error body) from a pydantic ValidationError, a FastAPI RequestValidationError, or their errors list.

    The first error decides `param` (a dotted path such as `temperature` or `messages.0.role`); alternatives that
    pydantic reports for the same field (one per member of a union) are joined into one message.
    """
    errors = list(exc.errors() if hasattr(exc, "errors") else exc)
    if not errors:
        return 400, error_body("invalid request", BAD_REQUEST_TYPE, None, 400)
    first = errors[0]
    param = _error_param(first)
    kind = first.get("type")
    if kind == "invalid_request":
        message = first["msg"]
    elif kind == "json_invalid":
        message = f"request body is not valid JSON: {(first.get('ctx') or {}).get('error', first.get('msg'))}"
    elif kind == "missing":
        message = f"{param}: field required" if param else "request body is required"
    else:
        msgs = []
        for err in errors:
            if _error_param(err) == param and err.get("type") not in ("invalid_request", "missing") \
                    and err["msg"] not in msgs:
                msgs.append(err["msg"])
        message = f"{param or 'request body'}: {'; or '.join(msgs)} (got {_short(first.get('input'))})"
    return 400, error_body(message, BAD_REQUEST_TYPE, param, 400)
