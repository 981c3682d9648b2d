"""Structured outputs (engine/grammar.py, server/constraints.py): llguidance masks in the sampler make sampled
outputs follow a JSON schema, a regex, a choice or a Lark grammar, on the completions API and offline; on chat
checkpoints the constraint sits inside the model's output format, and `tool_choice` "required" or a named tool
yields calls whose arguments are valid against the tool's schema. Sampled at temperature 1, so the masks (not the
model) must do the work; a constraint llguidance cannot compile is a 400 naming its field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from deltaserve import InvalidRequestError, LLM, SamplingParams
from deltaserve.default_model import default_model_path
from deltaserve.engine.sampling_params import StructuredOutputsParams
from server_utils import assert_all_free, run_server

# Bounded, so that a sample at temperature 1 can always close it within max_tokens: what is asserted is that every
# output that stops is valid, and that nearly all stop.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                   "b": {"type": "integer", "minimum": -99, "maximum": 99}}}}}
SAMPLES, PER_REQUEST = 100, 10


@pytest.fixture(scope="module")
def server():
    with run_server(default_model_path(), "--served-model-name", "code", "--kv-cache-memory", "64MiB",
                    "--dtype", "bfloat16") as s:
        yield s


def sample(server, prompt: str, **constraint) -> list[dict]:
    choices = []
    for seed in range(SAMPLES // PER_REQUEST):
        r = httpx.post(server.url + "/v1/completions", timeout=300, json={
            "model": "code", "prompt": prompt, "max_tokens": 256, "temperature": 1.0, "n": PER_REQUEST,
            "seed": seed, **constraint})
        assert r.status_code == 200, r.text
        choices += r.json()["choices"]
    return choices


def assert_valid_when_stopped(choices: list[dict], valid, stop_share: float = 0.9) -> None:
    stopped = [c for c in choices if c["finish_reason"] == "stop"]
    assert len(stopped) >= stop_share * len(choices), [c["text"] for c in choices if c["finish_reason"] != "stop"][:3]
    for c in stopped:
        assert valid(c["text"]), c["text"]


def test_json_schema_outputs_validate(server):
    def valid(text: str) -> bool:
        jsonschema.validate(json.loads(text), PERSON)
        return True
    choices = sample(server, "# a user record\nuser = ", response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert len(choices) == SAMPLES
    assert_valid_when_stopped(choices, valid)
    assert len({c["text"] for c in choices}) > 10  # sampled, not forced into one string
    assert_all_free(server)


def test_regex_outputs_match(server):
    choices = sample(server, "release_date = '", structured_outputs={"regex": DATE})
    assert_valid_when_stopped(choices, lambda text: re.fullmatch(DATE, text) is not None)


def test_choice_json_object_and_grammar(server):
    picks = sample(server, "mode = ", guided_choice=["'fast'", "'slow'", "None"])
    assert {c["text"] for c in picks} <= {"'fast'", "'slow'", "None"} and all(c["finish_reason"] == "stop"
                                                                              for c in picks)
    # any object: its strings are unbounded, so a sample may still be inside one at max_tokens
    objects = sample(server, "config = ", response_format={"type": "json_object"})
    assert_valid_when_stopped(objects, lambda text: isinstance(json.loads(text), dict), stop_share=0.3)
    lark = 'start: "x = " sum\nsum: NUMBER (" + " NUMBER)? (" + " NUMBER)?\nNUMBER: /[1-9][0-9]?/'
    sums = sample(server, "# arithmetic\n", structured_outputs={"grammar": lark})
    assert_valid_when_stopped(sums, lambda text: re.fullmatch(r"x = [1-9][0-9]?( \+ [1-9][0-9]?){0,2}", text))


def test_bad_constraints_are_400s_naming_the_field(server):
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}},
              "response_format.json_schema.schema"),
             ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
             ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
             ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
             ({"guided_json": "{not json"}, "guided_json"),
             ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex")]
    for extra, param in cases:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "code", "prompt": "x = ", "max_tokens": 4, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    assert_all_free(server)


def test_offline_structured_outputs():
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB")
    params = [SamplingParams(temperature=1.0, max_tokens=64, seed=s,
                             structured_outputs=StructuredOutputsParams(regex=DATE)) for s in range(8)]
    outs = llm.generate(["when = '"] * 8, params, use_tqdm=False)
    assert all(re.fullmatch(DATE, o.outputs[0].text) and o.outputs[0].finish_reason == "stop" for o in outs)
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "objekt"})),
                     use_tqdm=False)
    assert err.value.field == "structured_outputs"
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["b"]))


# ------------------------------------------------------------------------------------------- chat checkpoints
@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny"])
def test_chat_tool_choice_and_response_format(make_checkpoint, preset):
    with run_server(make_checkpoint(preset), "--served-model-name", "chat", "--kv-cache-memory", "64MiB") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
        messages = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
        off = {"chat_template_kwargs": {"thinking": False}}  # a random model never ends its reasoning by itself
        named = client.chat.completions.create(
            model="chat", messages=messages, tools=[WEATHER, ADD], n=10, temperature=1.0, max_tokens=200, seed=3,
            tool_choice={"type": "function", "function": {"name": "add"}}, extra_body=off)
        for choice in named.choices:
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
        # one call, its arguments bounded by the schemas: every choice ends with it
        single = client.chat.completions.create(
            model="chat", messages=messages, tools=[WEATHER, ADD], n=10, temperature=1.0, max_tokens=300, seed=4,
            tool_choice="required", parallel_tool_calls=False, extra_body=off)
        for choice in single.choices:
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            tool = {"get_weather": WEATHER, "add": ADD}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        # parallel calls: a random model may go on calling until max_tokens, but each choice starts with a whole call
        required = client.chat.completions.create(
            model="chat", messages=messages, tools=[WEATHER, ADD], n=10, temperature=1.0, max_tokens=300, seed=4,
            tool_choice="required", extra_body=off)
        for choice in required.choices:
            assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls, choice
            first = choice.message.tool_calls[0]
            tool = {"get_weather": WEATHER, "add": ADD}[first.function.name]
            jsonschema.validate(json.loads(first.function.arguments), tool["function"]["parameters"])
        formatted = client.chat.completions.create(
            model="chat", messages=messages, n=10, temperature=1.0, max_tokens=200, seed=5, extra_body=off,
            response_format={"type": "json_schema", "json_schema": {"name": "add", "schema": ADD["function"][
                "parameters"]}})
        for choice in formatted.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), ADD["function"]["parameters"])
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="chat", messages=messages, tools=[ADD], tool_choice="required",
                                           response_format={"type": "json_object"}, max_tokens=8)
        assert err.value.body["param"] == "tool_choice"
        assert_all_free(s)


def test_compiled_grammars_are_cached_and_copied():
    from deltaserve.engine.grammar import CACHE_SIZE, Grammars
    from deltaserve.tokenizer import load_tokenizer
    tok = load_tokenizer(default_model_path())
    grammars = Grammars(tok, tok.vocab_size, [tok.eos_token_id])
    text = grammars.compile(StructuredOutputsParams(json=PERSON))
    assert grammars.compile(StructuredOutputsParams(json=PERSON)) == text  # validated once, then remembered
    first, second = grammars.matcher(text), grammars.matcher(text)
    assert first is not second
    start = grammars.allowed([second])
    for token in tok.encode('{"name": "ab'):
        assert first.consume_token(token)
    # advancing one completion's matcher leaves the other, and the cached start, where they were
    assert bool((grammars.allowed([second]) == start).all()) and not bool((grammars.allowed([first]) == start).all())
    assert bool((grammars.allowed([grammars.matcher(text)]) == start).all())
    for k in range(CACHE_SIZE + 1):  # the cache stays bounded
        grammars.matcher(grammars.compile(StructuredOutputsParams(regex=f"a{{{k + 1}}}")))
    assert len(grammars._compiled) == CACHE_SIZE and len(grammars._checked) <= CACHE_SIZE
