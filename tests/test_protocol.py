"""OpenAI protocol models (docs/serving.md §10), request limits and Prometheus metrics (§11): fast, no engine, no
model."""

import argparse
import asyncio
import json

import pytest
from pydantic import ValidationError
from starlette.responses import PlainTextResponse

from deltaserve.engine.sampling_params import InvalidRequestError
from deltaserve.server.leased_response import leased
from deltaserve.server.limits import QueueFullError, RequestLimits, SequenceQueue
from deltaserve.server.metrics import Metrics
from deltaserve.server.protocol import (
    SSE_DONE, ChatCompletionChunk, ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionLogProbsContent,
    ChatCompletionRequest, ChatCompletionResponse, ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
    ChatMessage, CompletionLogProbs, CompletionRequest, CompletionResponse, CompletionResponseChoice,
    CompletionResponseStreamChoice, CompletionStreamResponse, DeltaFunctionCall, DeltaMessage, DeltaToolCall,
    DetokenizeRequest, DetokenizeResponse, ErrorResponse, FunctionCall, ModelCard, ModelList, TokenizeRequest,
    TokenizeResponse, ToolCall, UsageInfo, error_body, invalid_request_body, sse_event, validation_error_body)
from deltaserve.server.serve import add_cli_args

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **kw})


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hello", **kw})


def error_of(cls, payload) -> dict:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(payload)
    status, body = validation_error_body(info.value)
    assert status == 400
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
    return body["error"]


# ---------------------------------------------------------------------------------------------------------------------
# Mapping to SamplingParams


def test_completion_defaults():
    p = completion().to_sampling_params(100)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16  # vLLM's completions default
    assert (p.stop, p.stop_token_ids, p.logprobs, p.seed, p.min_tokens) == ([], [], None, None, 0)
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output


def test_completion_field_mapping():
    req = completion(max_tokens=40, temperature=0, top_p=0.9, top_k=-1, min_p=0.05, presence_penalty=0.5,
                     frequency_penalty=-0.5, repetition_penalty=1.1, seed=7, n=2, best_of=2, stop="END",
                     stop_token_ids=[3, 4], include_stop_str_in_output=True, ignore_eos=True, min_tokens=2,
                     logprobs=5, skip_special_tokens=False)
    p = req.to_sampling_params(100)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (40, 0, 0.9, 0, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (p.seed, p.n, p.stop, p.stop_token_ids, p.min_tokens, p.logprobs) == (7, 2, ["END"], [3, 4], 2, 5)
    assert p.include_stop_str_in_output and p.ignore_eos and not p.skip_special_tokens and p.greedy


def test_completion_max_tokens_null_uses_default_and_generation_defaults():
    req = completion(max_tokens=None)
    assert req.to_sampling_params(50).max_tokens == 50
    assert req.to_sampling_params(None).max_tokens is None
    p = req.to_sampling_params(50, defaults={"max_tokens": 20, "temperature": 0.6, "top_k": 5})
    assert (p.max_tokens, p.temperature, p.top_k) == (20, 0.6, 5)
    assert completion(temperature=0.2).to_sampling_params(50, defaults={"temperature": 0.6}).temperature == 0.2


def test_completion_prompts():
    assert completion().prompts() == ["hello"]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert completion(prompt=[[1], [2, 3]]).prompt_list() == [[1], [2, 3]]


def test_chat_field_mapping():
    p = chat(max_completion_tokens=9, max_tokens=100, logprobs=True, top_logprobs=4, temperature=0.3,
             stop=["a", "b"]).to_sampling_params(1000)
    assert (p.max_tokens, p.logprobs, p.temperature, p.stop) == (9, 4, 0.3, ["a", "b"])
    assert chat(max_tokens=12).to_sampling_params(1000).max_tokens == 12
    assert chat().to_sampling_params(1000).max_tokens == 1000  # chat has no fixed default
    assert chat().to_sampling_params(None).max_tokens is None
    assert chat(logprobs=True).to_sampling_params(10).logprobs == 0
    assert chat(logprobs=False).to_sampling_params(10).logprobs is None
    assert chat().to_sampling_params(10).temperature == 1.0


def test_chat_sampling_error_names_request_field():
    req = chat(min_tokens=5)
    with pytest.raises(InvalidRequestError) as info:
        req.to_sampling_params(3)  # the server's default leaves no room for min_tokens
    assert info.value.field == "min_tokens"
    status, body = invalid_request_body(info.value)
    assert status == 400 and body["error"]["param"] == "min_tokens"


def test_chat_helpers():
    req = chat(messages=[{"role": "system", "content": "s", "name": None},
                         {"role": "assistant", "content": None, "reasoning": "r",
                          "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}]},
                         {"role": "tool", "content": "18", "tool_call_id": "c1"}],
               tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
               response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}})
    assert req.messages[0] == {"role": "system", "content": "s"}
    assert req.messages[1]["reasoning"] == "r" and req.messages[1]["tool_calls"][0]["type"] == "function"
    assert req.tool_dicts()[0]["function"]["name"] == "get_weather"
    assert req.tool_choice_value() == {"type": "function", "function": {"name": "get_weather"}}
    assert req.response_format_dict() == {"type": "json_schema", "json_schema": {"name": "w",
                                                                                  "schema": {"type": "object"}}}
    assert chat().effective_tool_choice == "none" and chat(tools=TOOLS).effective_tool_choice == "auto"
    assert chat(tools=TOOLS, tool_choice="auto").tool_choice_value() is None
    assert chat(tools=TOOLS, tool_choice="required").tool_choice_value() == "required"


def test_thinking_resolution():
    # without a switch or an effort, the model's default decides
    assert chat().thinking_settings(True) == (True, None)
    assert chat().thinking_settings(False) == (False, None)
    assert chat(reasoning_effort="none").thinking_settings(True) == (False, None)
    assert chat(reasoning_effort="high").thinking_settings(False) == (True, "high")
    assert chat(reasoning_effort="xhigh").thinking_settings(True) == (True, "max")
    assert chat(chat_template_kwargs={"enable_thinking": False}).thinking_settings(True) == (False, None)
    assert chat(chat_template_kwargs={"thinking": True}).thinking_settings(False) == (True, None)
    kw = chat(reasoning_effort="low", chat_template_kwargs={"thinking": True, "thinking_effort": "medium", "x": 1})
    assert kw.template_kwargs(False) == {"x": 1, "thinking": True, "thinking_effort": "medium"}


def test_tokenize_requests():
    t = TokenizeRequest.model_validate({"prompt": "hi"})
    assert t.use_special_tokens and t.messages is None
    t = TokenizeRequest.model_validate({"messages": USER, "add_generation_prompt": False})
    assert not t.use_special_tokens and t.messages == USER
    assert DetokenizeRequest.model_validate({"tokens": [1, 2]}).tokens == [1, 2]


def test_extra_fields_ignored():
    req = chat(foo=1, functions=[], messages=[{"role": "user", "content": "x"}], metadata={"a": "b"})
    assert not hasattr(req, "foo") and "foo" not in req.model_dump()
    assert "foo" not in completion(foo={"bar": 1}).model_dump()
    assert TokenizeRequest.model_validate({"prompt": "x", "bogus": 1}).prompt == "x"


def test_stream_options():
    req = chat(stream=True, stream_options={"include_usage": True})
    assert req.stream_options.include_usage and not req.stream_options.continuous_usage_stats
    assert completion(stream=True, stream_options={}).stream_options.include_usage  # vLLM's default


# ---------------------------------------------------------------------------------------------------------------------
# Invalid payloads -> OpenAI error bodies naming the field

CHAT_INVALID = [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"max_completion_tokens": True}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"seed": "abc"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "messages.0.tool_calls.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
    ({"chat_template_kwargs": {"thinking_effort": "huge"}}, "chat_template_kwargs.thinking_effort"),
    ({"chat_template_kwargs": {"thinking": True, "enable_thinking": False}}, "chat_template_kwargs.enable_thinking"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"parallel_tool_calls": "x"}, "parallel_tool_calls"),
    ({"model": 5}, "model"),
]


@pytest.mark.parametrize("overrides,param", CHAT_INVALID, ids=[p for _, p in CHAT_INVALID])
def test_chat_invalid(overrides, param):
    err = error_of(ChatCompletionRequest, {"messages": USER, **overrides})
    assert err["param"] == param
    assert param.split(".")[-1] in err["message"] or param.split(".")[0] in err["message"]


COMPLETION_INVALID = [
    ({"prompt": None}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"echo": "yes"}, "echo"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"min_tokens": 17}, "min_tokens"),
    ({"temperature": True}, "temperature"),
    ({"logit_bias": "x"}, "logit_bias"),
]


@pytest.mark.parametrize("overrides,param", COMPLETION_INVALID, ids=[p for _, p in COMPLETION_INVALID])
def test_completion_invalid(overrides, param):
    err = error_of(CompletionRequest, {"prompt": "hi", **overrides})
    assert err["param"] == param and param in err["message"]


def test_missing_prompt_and_non_object_body():
    assert error_of(CompletionRequest, {})["param"] == "prompt"
    err = error_of(CompletionRequest, [1, 2])
    assert err["param"] is None and "dictionary" in err["message"]
    assert error_of(TokenizeRequest, {})["param"] == "prompt"
    assert error_of(TokenizeRequest, {"prompt": "a", "messages": USER})["param"] == "messages"
    assert error_of(DetokenizeRequest, {"tokens": [1, -2]})["param"] == "tokens.1"


def test_valid_edge_values_accepted():
    chat(temperature=0, top_p=1, top_k=-1, min_p=0, presence_penalty=-2, frequency_penalty=2, n=3, seed=-1,
         top_logprobs=0, logprobs=False, logit_bias={}, stream_options=None, tool_choice="none")
    completion(prompt="", logprobs=0, best_of=1, suffix=None, logit_bias=None, temperature=1)
    chat(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
         continue_final_message=True, add_generation_prompt=False)


LONE = "\ud800"
BIG = 2 ** 64  # one past what msgpack carries

UNREPRESENTABLE = [
    (CompletionRequest, {"prompt": LONE}, "prompt"),
    (CompletionRequest, {"prompt": ["ok", "b" + LONE]}, "prompt.1"),
    (CompletionRequest, {"prompt": [1, BIG]}, "prompt.1"),
    (CompletionRequest, {"prompt": "a", "stop": LONE}, "stop"),
    (CompletionRequest, {"prompt": "a", "stop": ["x", LONE]}, "stop.1"),
    (CompletionRequest, {"prompt": "a", "cache_salt": LONE}, "cache_salt"),
    (CompletionRequest, {"prompt": "a", "user": LONE}, "user"),
    (CompletionRequest, {"prompt": "a", "top_k": BIG}, "top_k"),
    (CompletionRequest, {"prompt": "a", "min_tokens": BIG}, "min_tokens"),
    (CompletionRequest, {"prompt": "a", "stop_token_ids": [3, BIG]}, "stop_token_ids.1"),
    (CompletionRequest, {"prompt": "a", "priority": -BIG}, "priority"),
    (CompletionRequest, {"prompt": "a", "unknown_field": {"k": [LONE]}}, "unknown_field.k.0"),
    (CompletionRequest, {"prompt": "a", "kv_transfer_params": {LONE: 1}}, "kv_transfer_params"),
    (CompletionRequest, {"prompt": "a", "temperature": float("inf")}, "temperature"),
    (ChatCompletionRequest, {"messages": [USER[0], {"role": "user", "content": LONE}]}, "messages.1.content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages.0.content.0.text"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi", "name": LONE}]}, "messages.0.name"),
    (ChatCompletionRequest, {"messages": USER, "tools": [{"type": "function", "function": {"name": LONE}}]},
     "tools.0.function.name"),
    (ChatCompletionRequest, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {LONE: {}}}}}]},
     "tools.0.function.parameters.properties"),
    (ChatCompletionRequest, {"messages": USER, "chat_template_kwargs": {"x": LONE}}, "chat_template_kwargs.x"),
    (TokenizeRequest, {"prompt": LONE}, "prompt"),
    (DetokenizeRequest, {"tokens": [BIG]}, "tokens.0"),
]


@pytest.mark.parametrize("cls,payload,param", UNREPRESENTABLE, ids=[p for _, _, p in UNREPRESENTABLE])
def test_values_the_engine_cannot_carry_name_their_path(cls, payload, param):
    err = error_of(cls, payload)
    assert err["param"] == param and err["message"].startswith(param)
    json.dumps(err).encode("utf-8")  # the error itself must be sendable


def test_representable_edges_accepted():
    completion(seed=2 ** 64 - 1, top_k=2 ** 63 - 1, stop_token_ids=[2 ** 63 - 1], priority=-(2 ** 63))
    completion(seed=-(2 ** 63), n=5)
    chat(messages=[{"role": "user", "content": "\U0001F600 \u00e9 \ud7ff \ue000"}])


@pytest.mark.parametrize("n,seed,ok", [(2, 2 ** 64 - 2, True), (2, 2 ** 64 - 1, False), (5, 2 ** 64 - 5, True),
                                       (5, 2 ** 64 - 4, False), (1, 2 ** 64 - 1, True)])
def test_seed_plus_n_must_stay_in_range(n, seed, ok):
    if ok:
        assert completion(n=n, seed=seed).to_sampling_params(None).seed == seed
    else:
        err = error_of(CompletionRequest, {"prompt": "a", "n": n, "seed": seed})
        assert err["param"] == "seed" and "seed + i" in err["message"]


BAD_SCHEMAS = [{"type": "nope"}, {"type": "object", "properties": []}, {"required": "x"}, {"minLength": -1},
               {"$schema": "http://json-schema.org/draft-07/schema#", "type": 5}]


@pytest.mark.parametrize("schema", BAD_SCHEMAS, ids=range(len(BAD_SCHEMAS)))
def test_invalid_tool_and_response_schemas(schema):
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": schema}}]
    err = error_of(ChatCompletionRequest, {"messages": USER, "tools": tools})
    assert err["param"] == "tools.1.function.parameters" and "not a valid JSON schema" in err["message"]
    err = error_of(TokenizeRequest, {"messages": USER, "tools": tools})
    assert err["param"] == "tools.1.function.parameters"
    err = error_of(ChatCompletionRequest, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": schema}}})
    assert err["param"] == "response_format.json_schema.schema"


def test_valid_tool_schemas_accepted():
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["a", "b"]}},
              "required": ["city"], "additionalProperties": False}
    req = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])
    assert req.tool_dicts()[0]["function"]["parameters"] == schema
    chat(tools=[{"type": "function", "function": {"name": "g"}}])


def test_fastapi_style_errors():
    # FastAPI prefixes locations with "body"; JSON decode errors name no field.
    errors = [{"type": "greater_than_equal", "loc": ("body", "temperature"), "msg": "Input should be >= 0",
               "input": -1, "ctx": {"ge": 0}}]
    status, body = validation_error_body(errors)
    assert status == 400 and body["error"]["param"] == "temperature"
    status, body = validation_error_body([{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error",
                                           "input": {}, "ctx": {"error": "Expecting value"}}])
    assert body["error"]["param"] is None and "JSON" in body["error"]["message"]


def test_error_body_shape():
    assert error_body("nope", "NotFoundError", "model", 404) == {
        "error": {"message": "nope", "type": "NotFoundError", "param": "model", "code": 404}}
    assert error_body("x")["error"] == {"message": "x", "type": "BadRequestError", "param": None, "code": None}
    ErrorResponse.model_validate(error_body("x"))


# ---------------------------------------------------------------------------------------------------------------------
# Response shapes


def test_completion_response_shape():
    lp = CompletionLogProbs(text_offset=[0], token_logprobs=[-0.1], tokens=["a"], top_logprobs=[{"a": -0.1}])
    resp = CompletionResponse(model="m", choices=[CompletionResponseChoice(index=0, text="a", logprobs=lp,
                                                                           finish_reason="length")],
                              usage=UsageInfo.make(3, 1, cached_tokens=2))
    d = json.loads(resp.model_dump_json())
    assert set(d) == {"id", "object", "created", "model", "choices", "usage"}
    assert d["object"] == "text_completion" and d["id"].startswith("cmpl-")
    assert {"index", "text", "logprobs", "finish_reason"} <= set(d["choices"][0])
    assert set(d["choices"][0]["logprobs"]) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert d["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                          "prompt_tokens_details": {"cached_tokens": 2},
                          "completion_tokens_details": {"reasoning_tokens": 0}}
    chunk = CompletionStreamResponse(model="m", choices=[CompletionResponseStreamChoice(index=0, text="b")])
    d = json.loads(chunk.model_dump_json())
    assert "usage" not in d and d["choices"][0]["finish_reason"] is None
    d = json.loads(CompletionStreamResponse(model="m", usage=UsageInfo.make(1, 2)).model_dump_json())
    assert d["choices"] == [] and d["usage"]["total_tokens"] == 3


def test_chat_response_shape():
    top = [ChatCompletionLogProb(token="b", logprob=-1.0, bytes=[98])]
    lp = ChatCompletionLogProbs(content=[ChatCompletionLogProbsContent(token="a", logprob=-0.5, bytes=[97],
                                                                       top_logprobs=top)])
    msg = ChatMessage(content="ok", reasoning_content="why",
                      tool_calls=[ToolCall(function=FunctionCall(name="f", arguments='{"x": 1}'))])
    resp = ChatCompletionResponse(model="m", choices=[ChatCompletionResponseChoice(
        index=0, message=msg, logprobs=lp, finish_reason="tool_calls")], usage=UsageInfo.make(5, 2, 0, 1))
    d = json.loads(resp.model_dump_json())
    assert d["object"] == "chat.completion" and d["id"].startswith("chatcmpl-")
    choice = d["choices"][0]
    assert {"index", "message", "logprobs", "finish_reason"} <= set(choice)
    assert {"role", "content", "reasoning_content", "tool_calls"} <= set(choice["message"])
    call = choice["message"]["tool_calls"][0]
    assert set(call) == {"id", "type", "function"} and call["type"] == "function" and call["id"].startswith("call_")
    assert set(call["function"]) == {"name", "arguments"}
    entry = choice["logprobs"]["content"][0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    assert d["usage"]["completion_tokens_details"] == {"reasoning_tokens": 1}


def test_chat_chunk_shape_and_sse():
    first = ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[ChatCompletionResponseStreamChoice(
        index=0, delta=DeltaMessage(role="assistant", content=""))])
    d = json.loads(first.model_dump_json())
    assert d["object"] == "chat.completion.chunk" and "usage" not in d
    assert d["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert d["choices"][0]["finish_reason"] is None and "logprobs" in d["choices"][0]
    call = ChatCompletionChunk(model="m", choices=[ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(
        tool_calls=[DeltaToolCall(index=0, id="call_1", type="function",
                                  function=DeltaFunctionCall(name="f", arguments="{}"))]))])
    delta = json.loads(call.model_dump_json())["choices"][0]["delta"]
    assert delta == {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "f", "arguments": "{}"}}]}
    reasoning = DeltaMessage(reasoning_content="r").model_dump()
    assert reasoning == {"reasoning_content": "r"}
    last = ChatCompletionChunk(model="m", usage=UsageInfo.make(2, 3))
    event = sse_event(last)
    assert event.startswith("data: ") and event.endswith("\n\n")
    d = json.loads(event[len("data: "):])
    assert d["choices"] == [] and d["usage"]["total_tokens"] == 5
    assert SSE_DONE == "data: [DONE]\n\n"


def test_misc_response_shapes():
    d = ModelList(data=[ModelCard(id="k3", max_model_len=4096)]).model_dump()
    assert d["object"] == "list" and {"id", "object", "created", "owned_by", "max_model_len"} <= set(d["data"][0])
    assert d["data"][0]["object"] == "model"
    d = TokenizeResponse(count=2, max_model_len=10, tokens=[1, 2]).model_dump()
    assert {"count", "max_model_len", "tokens"} <= set(d)
    assert DetokenizeResponse(prompt="hi").model_dump() == {"prompt": "hi"}


# ---------------------------------------------------------------------------------------------------------------------
# Metrics

METRIC_NAMES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "state_slots_usage_perc",
    "checkpoint_slots_used", "num_preemptions_total", "prompt_tokens_total", "prompt_tokens_cached_total",
    "generation_tokens_total", "request_success_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
    "kda_checkpoint_hits_total", "kda_checkpoints_evicted_total", "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_accepted_tokens_per_pos_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "iteration_tokens", "kv_transfer_seconds", "kv_transfer_bytes_total",
    "kv_transfer_failures_total", "kv_expired_requests_total", "cache_config_info",
]


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_names():
    m = Metrics(cache_config={"block_size": 16})
    body, content_type = m.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    for name in METRIC_NAMES:
        assert f"# TYPE deltaserve:{name} " in text, name
        assert f"deltaserve:{name}" in set(m.metric_names()), name
    assert "deltaserve:cache_config_info{block_size=\"16\"} 1.0" in text
    assert "deltaserve:prompt_tokens_total 0.0" in text
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert line.startswith("deltaserve:"), line


def test_metrics_registries_are_independent():
    a, b = Metrics(), Metrics()
    a.on_finish("stop", 1.0, 10, 0, 5)
    assert _samples(b.render()[0].decode())["deltaserve:prompt_tokens_total"] == 0


def test_metrics_counters_move():
    m = Metrics()
    m.observe_engine_stats({"num_running": 2, "num_waiting": 3, "kv_cache_usage": 0.5, "state_slot_usage": 0.25,
                            "num_preemptions": 2, "iteration_tokens": [8, 40]})
    m.observe_engine_stats({"num_running": 1, "num_waiting": 0, "num_preemptions": 5, "iteration_tokens": 3})
    m.observe_engine_stats({"num_preemptions": 1})  # lower than before: an engine restart, counts in full
    m.on_first_token(0.05)
    m.on_token(0.01)
    m.on_token(0.02)
    m.on_finish("stop", 1.5, 100, 64, 20, queue_s=0.1)
    m.on_finish("length", 2.0, 10, 0, 16)
    s = _samples(m.render()[0].decode())
    assert s["deltaserve:num_requests_running"] == 1
    assert s['deltaserve:num_requests_waiting{reason="capacity"}'] == 0
    assert s["deltaserve:kv_cache_usage_perc"] == 0.5 and s["deltaserve:state_slots_usage_perc"] == 0.25
    assert s["deltaserve:num_preemptions_total"] == 6
    assert s["deltaserve:iteration_tokens_count"] == 3 and s["deltaserve:iteration_tokens_sum"] == 51
    assert s["deltaserve:time_to_first_token_seconds_count"] == 1
    assert s["deltaserve:inter_token_latency_seconds_count"] == 2
    assert s["deltaserve:e2e_request_latency_seconds_count"] == 2
    assert s["deltaserve:e2e_request_latency_seconds_sum"] == 3.5
    assert s["deltaserve:request_queue_time_seconds_count"] == 1
    assert s["deltaserve:prompt_tokens_total"] == 110 and s["deltaserve:prompt_tokens_cached_total"] == 64
    assert s["deltaserve:generation_tokens_total"] == 36
    assert s["deltaserve:prefix_cache_queries_total"] == 110 and s["deltaserve:prefix_cache_hits_total"] == 64
    assert s['deltaserve:request_success_total{finished_reason="stop"}'] == 1
    assert s['deltaserve:request_success_total{finished_reason="length"}'] == 1


def test_metrics_labelled_gauges_and_spec_counters():
    m = Metrics()
    m.observe_engine_stats({"num_waiting_by_reason": {"capacity": 2, "kv_transfer": 1},
                            "prefix_cache_ineffective": {"prompt_shorter_than_block": True},
                            "spec_decode_num_accepted_tokens_per_pos": [3, 1], "spec_decode_num_drafts": 4})
    m.observe_engine_stats({"num_waiting_by_reason": {"capacity": 1},
                            "spec_decode_num_accepted_tokens_per_pos": [5, 1, 2], "spec_decode_num_drafts": 6})
    m.observe_engine_stats({"kv_transfer_bytes": 1000, "kv_transfer_seconds": [0.1],
                            "kv_transfer_failures_by_stage": {"transfer": 1}, "kv_transfers_in_flight": 3})
    m.observe_engine_stats({"kv_transfer_bytes": 1024, "kv_transfer_seconds": [0.2],
                            "kv_transfer_failures_by_stage": {"transfer": 1, "handshake": 2}, "kv_transfers_in_flight": 1})
    s = _samples(m.render()[0].decode())
    assert s['deltaserve:num_requests_waiting{reason="capacity"}'] == 1
    assert s['deltaserve:num_requests_waiting{reason="kv_transfer"}'] == 0  # disappeared -> 0, not stale
    assert s['deltaserve:prefix_cache_ineffective{reason="prompt_shorter_than_block"}'] == 1
    assert s['deltaserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 5
    assert s['deltaserve:spec_decode_num_accepted_tokens_per_pos_total{position="2"}'] == 2
    assert s["deltaserve:spec_decode_num_drafts_total"] == 6
    assert s["deltaserve:kv_transfer_bytes_total"] == 1024 and s["deltaserve:kv_transfer_seconds_count"] == 2
    assert s['deltaserve:kv_transfer_failures_total{stage="transfer"}'] == 1
    assert s['deltaserve:kv_transfer_failures_total{stage="handshake"}'] == 2
    assert s["deltaserve:kv_transfers_in_flight"] == 1


@pytest.mark.parametrize("text", ["a\u2028b", "x\u0085y\u2029z", "plain"])
def test_sse_events_survive_line_readers_that_split_on_unicode_breaks(text):
    """A generated token can decode to U+2028, U+2029 or U+0085: raw inside the event's JSON, httpx's aiter_lines
    (str.splitlines) would cut the event in two. Both SSE writers escape them; the JSON decodes to the same text."""
    from httpx._decoders import LineDecoder

    from deltaserve.server.handlers import _sse
    from deltaserve.server.protocol import CompletionStreamResponse, sse_event

    chunk = CompletionStreamResponse.model_validate(
        {"id": "c1", "created": 0, "model": "m", "choices": [{"index": 0, "text": text}]})
    for event in (_sse({"choices": [{"text": text}]}), sse_event(chunk)):
        lines = [line for line in LineDecoder().decode(event) if line]
        assert len(lines) == 1 and lines[0].startswith("data: ")
        assert json.loads(lines[0][6:])["choices"][0]["text"] == text


# ---------------------------------------------------------------------------------------------------------------------
# Request limits and the sequence queue (server/limits.py)


def test_sequence_queue_counts_reserves_and_releases():
    queue = SequenceQueue(8)
    a = queue.take(4, "n")
    b = queue.take(4, "prompt")
    assert queue.in_flight == 8
    with pytest.raises(QueueFullError, match="8 queued or running, this request needs 1"):
        queue.take(1, "prompt")
    with pytest.raises(InvalidRequestError) as info:
        queue.take(9, "n")  # can never fit: a 400, not a 503 to retry
    assert info.value.field == "n"
    a.release()
    a.release()  # idempotent
    assert queue.in_flight == 4
    queue.take(4, "n").release()
    b.release()
    assert queue.in_flight == 0


def test_request_limits_name_the_field():
    limits = RequestLimits(max_n=4, max_prompts_per_request=2, max_tokens_per_request=100)
    limits.check_shape(4, 2, "prompt")
    for n, prompts, field in [(5, 1, "n"), (1, 3, "prompt")]:
        with pytest.raises(InvalidRequestError) as info:
            limits.check_shape(n, prompts, "prompt")
        assert info.value.field == field
    limits.check_tokens([10, 15], 2, 10, 64, "max_tokens")  # 2 * (20 + 25) = 90
    with pytest.raises(InvalidRequestError) as info:
        limits.check_tokens([10, 15], 2, 13, 64, "max_tokens")  # 2 * (23 + 28) = 102
    assert info.value.field == "max_tokens" and "102" in str(info.value)
    limits.check_tokens([10], 1, None, 100, "max_tokens")  # no max_tokens: the rest of the context, 100 in all
    with pytest.raises(InvalidRequestError) as info:
        limits.check_tokens([10], 2, None, 64, "max_completion_tokens")  # 2 * 64
    assert info.value.field == "max_completion_tokens" and "each sequence may fill the context" in str(info.value)


def test_leased_response_releases_when_sent_or_failed():
    queue = SequenceQueue(4)

    async def ok():
        return PlainTextResponse("hi")

    async def broken():
        raise InvalidRequestError("prompt", "bad")

    async def scenario():
        response = await leased(queue.take(3, "n"), ok())
        assert queue.in_flight == 3  # held until sent
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        assert queue.in_flight == 0 and sent[-1]["body"] == b"hi"
        with pytest.raises(InvalidRequestError):
            await leased(queue.take(2, "n"), broken())
        assert queue.in_flight == 0

    asyncio.run(scenario())


def test_limit_flags_must_be_positive():
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_cli_args(parser)
    args = parser.parse_args(["--max-n", "3", "--max-queue-len", "9"])
    assert (args.max_n, args.max_queue_len, args.max_prompts_per_request, args.max_tokens_per_request) == \
        (3, 9, 64, 1 << 20)
    for flag in ("--max-n", "--max-prompts-per-request", "--max-tokens-per-request", "--max-queue-len"):
        with pytest.raises(argparse.ArgumentError):
            parser.parse_args([flag, "0"])
