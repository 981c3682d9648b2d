"""POST /v1/responses against real `deltaserve serve` processes, driven by the `openai` client (httpx for raw bodies
and raw server-sent events).

Servers (module-scoped):
* `server`, once per family (K3.1 XTML and Kimi-Linear's K2 format), random tiny weights, --api-key, and a fault
  injected into every prompt holding one token: a response equals the chat completion of the same conversation
  (text, reasoning, usage), its stream is the typed event sequence whose deltas rebuild the final response, bad
  input gets a 400 naming the field, and a failure after the stream started ends it with an `error` event;
* `tool_server`: a K3.1 tiny model that has memorised (tests/memorize.py) a weather tool call for one conversation
  and an answer once the tool's result is in, so the whole tool loop runs through a real server.
Offline, the two pieces the servers rely on: how input items group into chat messages, and how parser deltas become
output items and events.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from deltaserve import load_tokenizer
from deltaserve.chat import render_chat
from deltaserve.config import ModelConfig
from deltaserve.server.output_base import Delta, ToolCallDelta
from deltaserve.server.responses import OutputItems
from deltaserve.server.responses_protocol import ResponsesRequest

from memorize import memorize
from server_utils import assert_all_free, integrity, metric, run_server

MODEL = "tiny-responses"
KEY = "sk-responses"
COMMON = ("--served-model-name", MODEL, "--kv-cache-memory", "64MiB", "--shutdown-timeout", "5")
MAX_MODEL_LEN = 2048
RARE = "\ua66e"  # a character whose bytes no other prompt of this module holds: the fault's trigger

WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = [{"type": "function", **WEATHER}]  # the Responses API's flat tool
CHAT_TOOLS = [{"type": "function", "function": WEATHER}]  # the same tool as chat completions takes it
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_REASONING, ANSWER_REASONING = "Ask the weather tool.", "The tool answered."
TOOL_RESULT, ANSWER = "sunny, 21 C", "It is sunny in Paris, 21 C."
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}

# (name, Responses request fields, the same conversation as chat completions fields)
CONVERSATIONS = [
    ("text-input-no-thinking",
     {"input": "Name three colours.", "reasoning": {"effort": "none"}},
     {"messages": [{"role": "user", "content": "Name three colours."}], "reasoning_effort": "none"}),
    ("items-thinking",
     {"instructions": "You are terse.",
      "input": [{"role": "developer", "content": "Answer in English."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi. "},
                                                                {"type": "input_text", "text": "Who are you?"}]},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Be brief."}]},
                {"type": "message", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": "A model.", "annotations": []}]},
                {"role": "user", "content": "Name three colours."}]},
     {"messages": [{"role": "system", "content": "You are terse."},
                   {"role": "developer", "content": "Answer in English."},
                   {"role": "user", "content": "Hi. Who are you?"},
                   {"role": "assistant", "content": "A model.", "reasoning_content": "Be brief."},
                   {"role": "user", "content": "Name three colours."}]}),
    ("tools-format-effort",
     {"input": QUESTION, "tools": TOOLS, "tool_choice": "auto", "reasoning": {"effort": "low"},
      "text": {"format": {"type": "json_schema", "name": "colour", "schema": SCHEMA}}},
     {"messages": QUESTION, "tools": CHAT_TOOLS, "tool_choice": "auto", "reasoning_effort": "low",
      "response_format": {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA}}}),

]


# --------------------------------------------------------------------------------------------------- fixtures
def _tokenizer_and_config(checkpoint):
    return load_tokenizer(checkpoint), ModelConfig.from_dict(json.loads((checkpoint / "config.json").read_text()))


@pytest.fixture(scope="module", params=["k31-tiny", "kimi-linear-tiny"])
def server(request, make_checkpoint):
    checkpoint = make_checkpoint(request.param)
    tok, _ = _tokenizer_and_config(checkpoint)
    # A token of RARE made only of non-ASCII bytes: no other (ASCII) prompt here can hold it.
    trigger = next(t for t in tok.encode(RARE) if min(tok.id_to_bytes(t)) >= 0x80)
    with run_server(checkpoint, *COMMON, "--max-model-len", str(MAX_MODEL_LEN),
                    "--fault-injection", f"sample:{trigger}", api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def _memorised_turns(tok, config) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy continuation) of the two turns of the weather tool loop, rendered as the chat path
    renders them: the question -> reasoning and a get_weather call; the question, that call and its result ->
    reasoning and the answer."""
    call = {"role": "assistant", "content": "", "reasoning_content": CALL_REASONING,
            "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]}
    result = {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": TOOL_RESULT}
    answer = {"role": "assistant", "content": ANSWER, "reasoning_content": ANSWER_REASONING}
    turns = []
    for history, turn in ((QUESTION, call), (QUESTION + [call, result], answer)):
        prompt = render_chat(tok, config, history, tools=CHAT_TOOLS)
        full = render_chat(tok, config, history + [turn], add_generation_prompt=False, tools=CHAT_TOOLS)
        assert full[:len(prompt)] == prompt
        turns.append((prompt, full[len(prompt):]))
    return turns


@pytest.fixture(scope="module")
def tool_server(make_checkpoint, tmp_path_factory):
    base = make_checkpoint("k31-tiny")
    checkpoint = memorize("k31-tiny", base, _memorised_turns(*_tokenizer_and_config(base)),
                          tmp_path_factory.mktemp("memorised") / "model")
    with run_server(checkpoint, *COMMON) as srv:
        yield srv


@pytest.fixture(scope="module")
def tool_client(tool_server):
    with openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


# ---------------------------------------------------------------------------------------------------- helpers
def reasoning_text(response) -> str:
    return "".join(part.text for item in response.output if item.type == "reasoning" for part in item.content or ())


def calls(response) -> list[tuple[str, str, str]]:
    return [(item.call_id, item.name, item.arguments) for item in response.output if item.type == "function_call"]


def chat_calls(completion) -> list[tuple[str, str, str]]:
    return [(c.id, c.function.name, c.function.arguments) for c in completion.choices[0].message.tool_calls or ()]


def assert_same_as_chat(response, completion) -> None:
    """Output and usage of a response equal those of the chat completion of the same conversation."""
    choice = completion.choices[0]
    assert response.output_text == (choice.message.content or "")
    assert reasoning_text(response) == (getattr(choice.message, "reasoning_content", None) or "")
    assert calls(response) == chat_calls(completion)
    assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    u, cu = response.usage, completion.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (cu.prompt_tokens, cu.completion_tokens,
                                                                 cu.total_tokens)
    assert u.output_tokens_details.reasoning_tokens == cu.completion_tokens_details.reasoning_tokens
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens


def item_shape(item, with_id: bool = False) -> tuple:
    """What an output item says: its type, status and text or call (and its id when asked)."""
    if item.type == "function_call":
        shape = (item.type, item.status, item.call_id, item.name, item.arguments)
    else:
        shape = (item.type, item.status, [part.text for part in item.content])
    return (item.id, *shape) if with_id else shape


def item_shapes(response) -> list[tuple]:
    """The output items without their random ids."""
    return [item_shape(item) for item in response.output]


def check_event_sequence(events: list) -> None:
    """The typed event grammar: lifecycle events around the items; each item added, its content built by deltas
    whose concatenation is the text its done events and its finished item carry, then done; output indices count
    up from 0; sequence numbers count up from 0; the terminal event carries every finished item."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert final.response.status == final.type.removeprefix("response.")
    assert {e.response.id for e in (events[0], events[1], final)} == {final.response.id}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    body = iter(events[2:-1])
    finished = []
    for added in body:
        assert added.type == "response.output_item.added" and added.output_index == len(finished)
        item, index = added.item, added.output_index
        assert item.status == "in_progress"
        if item.type == "function_call":
            delta = next(body)
            assert delta.type == "response.function_call_arguments.delta" and delta.item_id == item.id
            done = next(body)
            assert done.type == "response.function_call_arguments.done" and done.arguments == delta.delta
            text = done.arguments
        else:
            prefix = "response.reasoning_text" if item.type == "reasoning" else "response.output_text"
            part = next(body)
            assert part.type == "response.content_part.added" and part.item_id == item.id and part.part.text == ""
            pieces, event = [], next(body)
            while event.type == f"{prefix}.delta":
                assert (event.item_id, event.output_index, event.content_index) == (item.id, index, 0)
                pieces.append(event.delta)
                event = next(body)
            text = "".join(pieces)
            assert pieces and event.type == f"{prefix}.done" and event.text == text
            part_done = next(body)
            assert part_done.type == "response.content_part.done" and part_done.part.text == text
        item_done = next(body)
        assert item_done.type == "response.output_item.done" and item_done.output_index == index
        assert item_done.item.id == item.id and item_done.item.status in ("completed", "incomplete")
        got = item_done.item.arguments if item.type == "function_call" else item_done.item.content[0].text
        assert got == text
        finished.append(item_done.item)
    assert [item_shape(i, True) for i in final.response.output] == [item_shape(i, True) for i in finished]


# ------------------------------------------------------------------------------------------- same as chat
@pytest.mark.parametrize("name,fields,chat_fields", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_greedy_response_equals_chat_completion(client, name, fields, chat_fields):
    response = client.responses.create(model=MODEL, max_output_tokens=24, temperature=0,
                                       metadata={"case": name}, **fields)
    completion = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, **chat_fields)
    assert response.output_text or reasoning_text(response), "nothing generated: the comparison would be empty"
    assert_same_as_chat(response, completion)
    assert response.object == "response" and response.model == MODEL and response.id.startswith("resp_")
    assert response.metadata == {"case": name} and response.store is False and response.temperature == 0
    assert response.max_output_tokens == 24 and response.error is None
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output[-1].status == "incomplete"
    assert [t.name for t in response.tools] == [t["name"] for t in fields.get("tools", [])]
    assert response.tool_choice == fields.get("tool_choice", "none")
    assert response.text.format.type == fields.get("text", {"format": {"type": "text"}})["format"]["type"]


# --------------------------------------------------------------------------------------------------- streams
@pytest.mark.parametrize("name,fields,chat_fields", CONVERSATIONS[:2], ids=[c[0] for c in CONVERSATIONS[:2]])
def test_stream_events_build_the_response(client, name, fields, chat_fields):
    kw = dict(model=MODEL, max_output_tokens=24, temperature=0, **fields)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    check_event_sequence(events)
    streamed = events[-1].response
    assert item_shapes(streamed) == item_shapes(whole)
    assert streamed.output_text == whole.output_text and reasoning_text(streamed) == reasoning_text(whole)
    assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == (whole.usage.input_tokens,
                                                                          whole.usage.output_tokens)
    assert streamed.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens_details.reasoning_tokens
    assert streamed.status == whole.status


def test_stream_names_each_event_and_sends_no_done_marker(server):
    """On the wire each event is `event: TYPE` + `data: JSON` (the data's own `type`), and the stream ends with its
    terminal event, without chat's `[DONE]`."""
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 6, "temperature": 0, "stream": True}
    names, types = [], []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=server.headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[len("event: "):])
            elif line.startswith("data: "):
                types.append(json.loads(line[len("data: "):])["type"])
    assert names == types and names[-1] == "response.incomplete" and len(names) > 4


def test_failure_after_the_stream_started_is_an_error_event(server, client):
    """A request that fails inside the engine (an injected fault) ends its stream with an `error` event after the
    lifecycle events; non-streamed, it is a 500. The server goes on serving and its pools end free."""
    kw = dict(model=MODEL, input=f"Spell {RARE}.", max_output_tokens=8)
    events = list(client.responses.create(**kw, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    assert [e.sequence_number for e in events] == [0, 1, 2]
    assert events[-1].code == "InternalServerError" and "sample" in events[-1].message
    with pytest.raises(openai.InternalServerError):
        client.responses.create(**kw)
    assert client.responses.create(model=MODEL, input="Hello", max_output_tokens=2,
                                   temperature=0).usage.output_tokens == 2
    assert_all_free(server)


# ------------------------------------------------------------------------------------------------ bad input
BAD = [
    ("unknown-field", {"input": "hi", "frequency_penalty": 0.5}, "frequency_penalty"),
    ("unknown-nested-field", {"input": "hi", "text": {"format": {"type": "text"}, "verbosity": "low"}},
     "text.verbosity"),
    ("store-true", {"input": "hi", "store": True}, "store"),
    ("previous-response-id", {"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ("item-reference", {"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ("output-without-call", {"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
     "input.0.call_id"),
    ("image-part", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0"),
    ("bad-role", {"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ("empty", {"input": []}, "input"),
    ("hosted-tool", {"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ("bad-tool-schema", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}]},
     "tools.0.parameters"),
    ("chat-shaped-tool", {"input": "hi", "tools": CHAT_TOOLS}, "tools.0"),
    ("tool-choice-without-tools", {"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ("tool-choice-unknown-function", {"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function",
                                                                                     "name": "f"}}, "tool_choice"),
    ("json-schema-without-schema", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ("reasoning-summary", {"input": "hi", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ("encrypted-reasoning", {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e30="}]},
     "input.0.encrypted_content"),
    ("temperature-string", {"input": "hi", "temperature": "0"}, "temperature"),
    ("max-output-tokens-zero", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("max-output-tokens-beyond-context", {"input": "hi", "max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens"),
    ("too-much-metadata", {"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("lone-surrogate", {"input": "\ud800"}, "input"),
]


@pytest.mark.parametrize("name,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_400_naming_the_field(server, name, body, param):
    # json.dumps escapes a lone surrogate, which httpx's own encoder cannot encode
    r = httpx.post(server.url + "/v1/responses", content=json.dumps({"model": MODEL, **body}).encode(),
                   headers={**server.headers, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError" and error["message"], error


def test_model_and_key_are_checked_as_for_chat(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="no-such-model", input="hi", max_output_tokens=1)
    assert info.value.param == "model"
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 1}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert client.responses.create(input="hi", max_output_tokens=1).model == MODEL  # no model: the served one
    assert_all_free(server)


# ---------------------------------------------------------------------------------------------- tool loop
def test_function_call_item_and_the_tool_loop(tool_client):
    first = tool_client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, temperature=0)
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    assert first.status == "completed" and first.output_text == "" and reasoning_text(first) == CALL_REASONING
    (call_id, name, arguments), = calls(first)
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert first.output[1].status == "completed" and first.output[1].id.startswith("fc_")
    chat = tool_client.chat.completions.create(model=MODEL, messages=QUESTION, tools=CHAT_TOOLS, temperature=0)
    assert chat.choices[0].finish_reason == "tool_calls"
    assert_same_as_chat(first, chat)

    with tool_client.responses.stream(model=MODEL, input=QUESTION, tools=TOOLS, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    check_event_sequence(events)
    assert "response.function_call_arguments.delta" in {e.type for e in events}
    assert item_shapes(final) == item_shapes(first)

    # The client runs the tool and sends the whole conversation back: its earlier output items, then the result.
    result = {"type": "function_call_output", "call_id": call_id, "output": TOOL_RESULT}
    second = tool_client.responses.create(model=MODEL, input=QUESTION + first.output + [result], tools=TOOLS,
                                          temperature=0)
    assert [item.type for item in second.output] == ["reasoning", "message"]
    assert second.status == "completed" and second.output_text == ANSWER
    assert reasoning_text(second) == ANSWER_REASONING and calls(second) == []
    history = [{"role": "assistant", "content": "", "reasoning_content": CALL_REASONING,
                "tool_calls": [{"id": call_id, "type": "function",
                                "function": {"name": name, "arguments": arguments}}]},
               {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}]
    chat = tool_client.chat.completions.create(model=MODEL, messages=QUESTION + history, tools=CHAT_TOOLS,
                                               temperature=0)
    assert_same_as_chat(second, chat)

    # The same turn written by hand as plain items (no ids, no statuses) is the same conversation.
    by_hand = [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": CALL_REASONING}]},
               {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}, result]
    again = tool_client.responses.create(model=MODEL, input=QUESTION + by_hand, tools=TOOLS, temperature=0)
    assert again.output_text == ANSWER and again.usage.input_tokens == second.usage.input_tokens


def test_disconnect_frees_the_request(server):
    """A client that leaves a long response, streamed after its first events or non-streamed before the end, aborts
    it: its pages and slot come back, and it generated far fewer tokens than it was allowed."""
    # an array of at least 1500 items: whatever the random model's numbers, no end of text before 1500 tokens
    count = {"type": "json_schema", "name": "count",
             "schema": {"type": "array", "items": {"enum": [1]}, "minItems": 1500}}
    body = {"model": MODEL, "input": "Count to a thousand.", "max_output_tokens": 1500, "temperature": 0,
            "text": {"format": count}}
    generated = metric(server, "deltaserve:generation_tokens_total")
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, headers=server.headers,
                      timeout=60) as r:
        data = (json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: "))
        types = [next(data)["type"] for _ in range(6)]
        assert integrity(server)["free_slots"] < integrity(server)["total_slots"]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert_all_free(server, timeout=5)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/responses", json=body, headers=server.headers, timeout=1.0)
    assert_all_free(server, timeout=5)
    assert metric(server, "deltaserve:generation_tokens_total") - generated < 1500


# ------------------------------------------------------------------------------------- offline: the pieces
def test_assistant_side_items_group_into_turns():
    """Reasoning, text and calls join one assistant message in the order a model writes them; an item that cannot
    follow what the turn holds starts the next assistant message; other items end the turn."""
    def r(text):
        return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}

    def a(text):
        return {"role": "assistant", "content": text}

    def call(i):
        return {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}

    def tc(i):
        return {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}

    items = [{"role": "user", "content": "q"}, r("r1"), a("t1"), call(1), call(2),
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "o2"}]},
             {"type": "function_call_output", "call_id": "c1", "output": "o1", "name": "f"},
             a("t2"), a("t3"), r("r4"), r("r5"), call(3)]
    got = ResponsesRequest.model_validate({"input": items, "instructions": "sys"}).chat_prompt().messages
    assert got == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
                   {"role": "assistant", "content": "t1", "reasoning_content": "r1", "tool_calls": [tc(1), tc(2)]},
                   {"role": "tool", "tool_call_id": "c2", "content": "o2"},
                   {"role": "tool", "tool_call_id": "c1", "content": "o1", "name": "f"},
                   {"role": "assistant", "content": "t2"}, {"role": "assistant", "content": "t3"},
                   {"role": "assistant", "content": "", "reasoning_content": "r4"},
                   {"role": "assistant", "content": "", "reasoning_content": "r5", "tool_calls": [tc(3)]}]


def test_output_items_follow_the_deltas():
    """Items open and close as the kind of delta changes (reasoning again after text is a new item), calls are
    whole items, an item still open when the output is cut is incomplete, and every event carries its item."""
    items = OutputItems()
    deltas = [Delta(reasoning_content="th"), Delta(reasoning_content="ink"), Delta(content="Hel"),
              Delta(content="lo"), Delta(tool_calls=[ToolCallDelta(0, "functions.f:0", "f", '{"a":1}')]),
              Delta(tool_calls=[ToolCallDelta(1, "functions.g:1", "g", "{}")]), Delta(reasoning_content="more"),
              Delta(content="")]
    events = [e for d in deltas for e in items.feed(d)] + items.finish(cut=True)
    shapes = [(i["type"], i["status"], i.get("arguments", [p["text"] for p in i.get("content", [])]))
              for i in items.items]
    assert shapes == [("reasoning", "completed", ["think"]), ("message", "completed", ["Hello"]),
                      ("function_call", "completed", '{"a":1}'), ("function_call", "completed", "{}"),
                      ("reasoning", "incomplete", ["more"])]
    assert [i["call_id"] for i in items.items[2:4]] == ["functions.f:0", "functions.g:1"]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [0, 1, 2, 3, 4] and done == items.items
    deltas_text = [e["delta"] for e in events if e["type"].endswith("_text.delta")]
    assert deltas_text == ["th", "ink", "Hel", "lo", "more"]
    assert OutputItems().finish(cut=True) == []
