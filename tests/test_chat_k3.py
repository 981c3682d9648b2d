"""K3 XTML chat renderer (docs/chat.md §3.1–3.3, worked example §3.8) and the K2 Jinja path (§4), generated tokenizers.

Expected prompts are written out byte for byte; `xtml_ids` re-derives the ids from such a string by encoding the
text between markers with specials disallowed, so each test checks the exact ids, not only the decoded text.
"""

import json
import re

import pytest

from deltaserve.chat import ChatError, message_text, normalize_k3_messages, render_chat, render_template
from deltaserve.config import ModelConfig
from deltaserve.tokenizer import load_tokenizer
from deltaserve.tools.presets import get_preset
from deltaserve.tools.tokenizer_files import write_tokenizer_files

MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
_MARKER_RE = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")

EFFORT_MAX = ('<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to '
              "think in your thinking channel (not including the response channel), supported values include `low`, "
              "`medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=max`."
              "<|close|>message<|sep|><|end_of_msg|>")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "number"}},
                       "required": ["city"]},
    },
}
WEATHER_JSON = ('[{"function":{"description":"Get the weather for a city","name":"get_weather","parameters":'
                '{"properties":{"city":{"type":"string"},"days":{"type":"number"}},"required":["city"],'
                '"type":"object"}},"type":"function"}]')


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3_tok")
    write_tokenizer_files(path, "kimi_k3", 2048)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def config():
    return ModelConfig.from_dict(get_preset("k31-tiny").config)


def xtml_ids(tok, text: str, literal: str | None = None) -> list[int]:
    """Ids of an XTML string: markers as special ids, the text between them encoded with specials disallowed.
    Occurrences of `literal` are user text even if they spell a marker."""
    if literal:
        text = text.replace(literal, "\x00")
    ids = []
    for piece in _MARKER_RE.split(text):
        if piece in MARKERS:
            ids.append(tok.token_to_id(piece))
        elif piece:
            ids.extend(tok.encode(piece.replace("\x00", literal) if literal else piece))
    return ids


def check(tok, ids: list[int], expected: str, literal: str | None = None) -> None:
    assert tok.decode(ids) == expected
    assert ids == xtml_ids(tok, expected, literal)


def sp(tok, name):
    return tok.token_to_id(name)


# ------------------------------------------------------------------------------------------------ markers
def test_markers_are_single_special_ids(tok):
    ids = {name: tok.token_to_id(name) for name in MARKERS}
    assert all(tok.is_special(i) for i in ids.values())
    assert len(set(ids.values())) == 4
    # Real layout offsets (docs/chat.md §1.3): end_of_msg, open, close, sep are 163586..163589.
    assert [ids[n] - tok.num_bpe_ranks for n in ("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>")] == [2, 3, 4, 5]


def test_generation_prompt_is_open_think_sep(tok, config):
    ids = render_chat(tok, config, [{"role": "user", "content": "Hi"}])
    think = [sp(tok, "<|open|>")] + tok.encode("think") + [sp(tok, "<|sep|>")]
    assert ids[-len(think):] == think
    head = [sp(tok, "<|open|>")] + tok.encode('message role="assistant"') + [sp(tok, "<|sep|>")]
    assert ids[-len(think) - len(head):-len(think)] == head


def test_literal_marker_in_user_text_is_not_special(tok, config):
    text = 'say <|open|>think<|sep|> and <|end_of_msg|> "q" & done'
    ids = render_chat(tok, config, [{"role": "user", "content": text}], thinking=False)
    expected = (f'<|open|>message role="user"<|sep|>{text}<|close|>message<|sep|><|end_of_msg|>'
                '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    assert tok.decode(ids) == expected
    # Only the structural markers are special: 2 opens, 1 close, 3 seps, 1 end_of_msg.
    specials = [tok.id_to_token(i) for i in ids if tok.is_special(i)]
    assert specials == ["<|open|>", "<|sep|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|open|>", "<|sep|>",
                        "<|open|>", "<|sep|>"]
    body = ids[ids.index(sp(tok, "<|sep|>")) + 1:ids.index(sp(tok, "<|close|>"))]
    assert body == tok.encode(text) and not any(tok.is_special(i) for i in body)


# ------------------------------------------------------------------------------------------ worked example
def test_worked_example_3_8(tok, config):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
    ]
    ids = render_chat(tok, config, messages, tools=[WEATHER_TOOL])
    expected = (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\n'
        "Here are the available tools, described in JSONSchema.\n\n```json\n" + WEATHER_JSON + "\n```"
        "<|close|>message<|sep|><|end_of_msg|>"
        + EFFORT_MAX
        + '<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>Weather in Paris?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Need tool.<|close|>think<|sep|>'
        "<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>{"temp": 18}<|close|>message<|sep|>'
        "<|end_of_msg|>"
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    check(tok, ids, expected)
    # Same arguments given as an object render identically.
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 2}
    assert render_chat(tok, config, messages, tools=[WEATHER_TOOL]) == ids


def test_plain_chat_thinking_off(tok, config):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": 'a"&b'},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "ignored when thinking is off"},
                {"role": "user", "content": [{"type": "text", "text": "How "}, {"type": "text", "text": "are you?"}]}]
    ids = render_chat(tok, config, messages, thinking=False, thinking_effort="low")
    check(tok, ids,
          '<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
          '<|open|>message role="user" name="a&quot;&amp;b"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>'
          '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>Hello!<|close|>response<|sep|>'
          "<|close|>message<|sep|><|end_of_msg|>"
          '<|open|>message role="user"<|sep|>How are you?<|close|>message<|sep|><|end_of_msg|>'
          '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')


def test_reasoning_history_thinking_on(tok, config):
    messages = [{"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1", "reasoning": "R1", "name": "kimi"},
                {"role": "user", "content": "Q2"},
                {"role": "assistant", "content": "A2", "reasoning_content": "  \n"},
                {"role": "user", "content": "Q3"}]
    ids = render_chat(tok, config, messages, thinking_effort="high", add_generation_prompt=False)
    check(tok, ids,
          EFFORT_MAX.replace("thinking_effort=max", "thinking_effort=high")
          + '<|open|>message role="user"<|sep|>Q1<|close|>message<|sep|><|end_of_msg|>'
          '<|open|>message role="assistant" name="kimi"<|sep|><|open|>think<|sep|>R1<|close|>think<|sep|>'
          "<|open|>response<|sep|>A1<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
          '<|open|>message role="user"<|sep|>Q2<|close|>message<|sep|><|end_of_msg|>'
          '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
          "<|open|>response<|sep|>A2<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
          '<|open|>message role="user"<|sep|>Q3<|close|>message<|sep|><|end_of_msg|>')


@pytest.mark.parametrize("effort", ["low", "medium", "high", "max"])
def test_thinking_effort_values(tok, config, effort):
    ids = render_chat(tok, config, [{"role": "user", "content": "x"}], thinking_effort=effort)
    assert tok.decode(ids).startswith(EFFORT_MAX.replace("thinking_effort=max", f"thinking_effort={effort}"))


def test_thinking_effort_invalid(tok, config):
    with pytest.raises(ChatError, match="thinking_effort"):
        render_chat(tok, config, [{"role": "user", "content": "x"}], thinking_effort="extreme")


# ---------------------------------------------------------------------------------------------- tool calls
def test_argument_types_and_fallbacks(tok, config):
    literal = 'raw "text"\n<|close|>argument<|sep|>'
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {
            "s": literal, "n": 1.5, "i": -3, "b": False, "z": None,
            "o": {"k": "é", "l": [1, 2]}, "a": [True, "x"]}}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
        {"id": "c3", "type": "function", "function": {"name": "h", "arguments": "[1, 2]"}},
        {"id": "c4", "type": "function", "function": {"name": "k", "arguments": ""}},
    ]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok", "tool_calls": calls},
                {"role": "assistant", "content": "none", "tool_calls": []}]
    ids = render_chat(tok, config, messages, thinking=False, add_generation_prompt=False)
    check(tok, ids,
          '<|open|>message role="user"<|sep|>go<|close|>message<|sep|><|end_of_msg|>'
          '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|>'
          '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
          '<|open|>argument key="s" type="string"<|sep|>raw "text"\n<|close|>argument<|sep|><|close|>argument<|sep|>'
          '<|open|>argument key="n" type="number"<|sep|>1.5<|close|>argument<|sep|>'
          '<|open|>argument key="i" type="number"<|sep|>-3<|close|>argument<|sep|>'
          '<|open|>argument key="b" type="boolean"<|sep|>false<|close|>argument<|sep|>'
          '<|open|>argument key="z" type="null"<|sep|>null<|close|>argument<|sep|>'
          '<|open|>argument key="o" type="object"<|sep|>{"k": "é", "l": [1, 2]}<|close|>argument<|sep|>'
          '<|open|>argument key="a" type="array"<|sep|>[true, "x"]<|close|>argument<|sep|>'
          "<|close|>call<|sep|>"
          '<|open|>call tool="g" index="2"<|sep|><|open|>json type="object"<|sep|>not json<|close|>json<|sep|>'
          "<|close|>call<|sep|>"
          '<|open|>call tool="h" index="3"<|sep|><|open|>json type="object"<|sep|>[1, 2]<|close|>json<|sep|>'
          "<|close|>call<|sep|>"
          '<|open|>call tool="k" index="4"<|sep|><|close|>call<|sep|>'
          "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
          '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>none<|close|>response<|sep|>'
          "<|close|>message<|sep|><|end_of_msg|>", literal)
    # The string argument's literal marker text is ordinary BPE: exactly one structural close per element.
    assert tok.decode(ids).count("<|close|>argument<|sep|>") == 8
    # user 1 + response 1 + 7 arguments + call f 1 + (json, call) x 2 + call k 1 + tools 1 + message 1 + 2nd turn 2
    assert sum(1 for i in ids if i == sp(tok, "<|close|>")) == 1 + 1 + 7 + 1 + 4 + 1 + 1 + 1 + 2


def _three_calls():
    return [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": "{}"}}
            for i, n in enumerate(["alpha", "beta", "gamma"], start=1)]


def _tool_headers(text: str) -> list[str]:
    return re.findall(r'<\|open\|>message role="tool" tool="([^"]*)" index="(\d+)"<\|sep\|>([^<]*)<', text)


def test_tool_results_reordered_by_call_id(tok, config):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": _three_calls()},
                {"role": "tool", "tool_call_id": "c3", "content": "r3"},
                {"role": "tool", "tool_call_id": "c1", "content": "r1"},
                {"role": "tool", "tool_call_id": "beta:1", "content": "r2"},  # vLLM's name:position alias
                {"role": "user", "content": "next"}]
    text = tok.decode(render_chat(tok, config, messages, thinking=False))
    assert _tool_headers(text) == [("alpha", "1", "r1"), ("beta", "2", "r2"), ("gamma", "3", "r3")]
    assert text.index("r3<|close|>") < text.index('role="user"<|sep|>next')
    one = tok.decode(render_chat(tok, config, messages[:2] + [messages[2]], thinking=False))
    assert _tool_headers(one) == [("gamma", "3", "r3")]  # index = position of the matched call
    assert messages[2] == {"role": "tool", "tool_call_id": "c3", "content": "r3"}  # input untouched


def test_tool_results_fallback_keeps_order(tok, config):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": _three_calls()},
                {"role": "tool", "tool_call_id": "c3", "content": "r3"},
                {"role": "tool", "tool_call_id": "unknown", "name": "custom", "content": "rx"},
                {"role": "tool", "content": "r-last"}]
    text = tok.decode(render_chat(tok, config, messages, thinking=False))
    # One result cannot be resolved: original order, names from `tool`/`name` or by position, index by position.
    assert _tool_headers(text) == [("alpha", "1", "r3"), ("custom", "2", "rx"), ("gamma", "3", "r-last")]
    with pytest.raises(ChatError, match="tool name"):
        render_chat(tok, config, [{"role": "user", "content": "q"}, {"role": "tool", "content": "orphan"}])


def test_normalize_k3_messages_roles(tok):
    out = normalize_k3_messages([{"role": "developer", "content": "d"}])
    assert out == [{"role": "system", "content": "d"}]
    with pytest.raises(ChatError, match="role"):
        normalize_k3_messages([{"role": "robot", "content": "x"}])


def test_dynamic_tool_declaration(tok, config):
    messages = [{"role": "user", "content": "q"},
                {"role": "system", "content": "ignored", "tools": [{"name": "late", "parameters": {}}]}]
    ids = render_chat(tok, config, messages, thinking=False, add_generation_prompt=False)
    check(tok, ids,
          '<|open|>message role="user"<|sep|>q<|close|>message<|sep|><|end_of_msg|>'
          '<|open|>message role="system" type="tool-declare"<|sep|>## New Tools Available\n'
          "The system dynamically extends the toolset via lazy-loading.\n"
          "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
          '```json\n[{"name":"late","parameters":{}}]\n```<|close|>message<|sep|><|end_of_msg|>')


# -------------------------------------------------------------------------------- tool_choice / response_format
TAIL = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
USER = '<|open|>message role="user"<|sep|>x<|close|>message<|sep|><|end_of_msg|>'


@pytest.mark.parametrize("choice, body", [
    ("required", "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."),
    ("none", "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."),
    ("auto", None), (None, None),
    ({"type": "function", "function": {"name": "get_weather"}}, None),
])
def test_tool_choice(tok, config, choice, body):
    ids = render_chat(tok, config, [{"role": "user", "content": "x"}], thinking=False, tools=[WEATHER_TOOL],
                      tool_choice=choice)
    text = tok.decode(ids)
    middle = "" if body is None else (f'<|open|>message role="system" type="tool-choice"<|sep|>{body}'
                                      "<|close|>message<|sep|><|end_of_msg|>")
    assert text.endswith(USER + middle + TAIL)
    assert ids == xtml_ids(tok, text)


def test_tool_choice_invalid(tok, config):
    with pytest.raises(ChatError, match="tool_choice"):
        render_chat(tok, config, [{"role": "user", "content": "x"}], tool_choice="sometimes")


def test_response_format(tok, config):
    msgs = [{"role": "user", "content": "x"}]
    raw = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
    text = tok.decode(render_chat(tok, config, msgs, thinking=False, tool_choice="none",
                                  response_format={"type": "json_object"}))
    assert text.endswith(
        USER + '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with '
        "`tool_choice=none`.\nYou MUST NOT call any tools in the next message.<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system" type="response-format"<|sep|>The system is invoked with '
        f"`response_format=json_object`.\n{raw}<|close|>message<|sep|><|end_of_msg|>" + TAIL)
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    ids = render_chat(tok, config, msgs, thinking=False,
                      response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    check(tok, ids,
          USER + '<|open|>message role="system" type="response-format"<|sep|>The system is invoked with '
          f"`response_format=json_schema`.\n{raw}\nThe JSON data must match the following schema:\n```json\n"
          '{"properties":{"a":{"type":"string"},"b":{"type":"integer"}},"type":"object"}\n```'
          "<|close|>message<|sep|><|end_of_msg|>" + TAIL)
    assert render_chat(tok, config, msgs, thinking=False, response_format={"type": "text"}) == \
        render_chat(tok, config, msgs, thinking=False)
    with pytest.raises(ChatError, match="schema"):
        render_chat(tok, config, msgs, response_format={"type": "json_schema", "json_schema": {"name": "s"}})
    with pytest.raises(ChatError, match="response_format"):
        render_chat(tok, config, msgs, response_format={"type": "yaml"})


# ----------------------------------------------------------------------------------------------- errors
def test_image_and_unknown_parts_are_rejected_by_name(tok, config):
    """An image part needs a renderer given `image_ids` (a model with a vision tower); another kind of part is named.
    With `image_ids` the image's ids go in place, between the text parts' ids."""
    msg = {"role": "user", "content": [{"type": "text", "text": "see"},
                                       {"type": "image_url", "image_url": {"url": "data:"}}]}
    with pytest.raises(ChatError, match="this model takes no images"):
        render_chat(tok, config, [msg])
    with pytest.raises(ChatError, match=r"part 1 \(type 'audio_url'\)"):
        render_chat(tok, config, [{"role": "user", "content": [{"type": "text", "text": "hear"},
                                                               {"type": "audio_url", "audio_url": {"url": "x"}}]}])
    with_image = render_chat(tok, config, [msg], image_ids=lambda part: [7, 7, 7])
    plain = render_chat(tok, config, [{"role": "user", "content": "see"}])
    i = with_image.index(7)
    assert with_image[:i] == plain[:i] and with_image[i:i + 3] == [7, 7, 7] and with_image[i + 3:] == plain[i:]
    with pytest.raises(ChatError, match="role"):
        render_chat(tok, config, [{"role": "robot", "content": "x"}])
    with pytest.raises(ChatError, match="empty"):
        render_chat(tok, config, [])
    assert message_text({"content": None}) == ""


# --------------------------------------------------------------------------------------------- K2 template
@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    path = tmp_path_factory.mktemp("k2_tok")
    write_tokenizer_files(path, "kimi_linear", 2048)
    return load_tokenizer(path), ModelConfig.from_dict(get_preset("kimi-linear-tiny").config)


def test_k2_template_with_tools(k2):
    tok, config = k2
    assert config.family == "kimi_linear"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": "<x>", "a": "é"}}}]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok", "tool_calls": [
                    {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": "functions.f:0", "content": "r"}]
    ids = render_chat(tok, config, messages, tools=tools)
    assert ids == render_template(tok, messages, tools=tools)
    expected = ('<|im_system|>tool_declare<|im_middle|>' + json.dumps(tools, ensure_ascii=False) + "<|im_end|>"
                "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
                "<|im_user|>user<|im_middle|>hi<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>ok<|tool_calls_section_begin|><|tool_call_begin|>"
                'functions.f:0<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|>'
                "<|im_end|><|im_system|>tool<|im_middle|>## Return of functions.f:0\nr<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>")
    assert tok.decode(ids) == expected
    assert ids == tok.encode(expected, allow_special=True)
    for name in ("<|im_system|>", "<|tool_calls_section_begin|>", "<|tool_call_argument_begin|>", "<|im_end|>"):
        assert tok.token_to_id(name) in ids
    # Without tools there is no declaration; the Jinja path still rejects image parts by name.
    assert not tok.decode(render_chat(tok, config, messages[:1])).startswith("<|im_system|>tool_declare")
    with pytest.raises(ChatError, match="image_url"):
        render_chat(tok, config, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
