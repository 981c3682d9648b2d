"""Output parsers on token ids (docs/chat.md §3.4–3.6, §4): K3 XTML and K2 section markers, streamed and not.

Realistic model outputs come from the renderer: an assistant turn rendered into a conversation, minus the prompt
that precedes it (whose generation prompt opens the think or response channel, as at inference time).
"""

import json
import random
from types import SimpleNamespace

import pytest

from deltaserve.chat import render_chat
from deltaserve.config import ModelConfig
from deltaserve.server.parsers import (
    Delta, K2OutputParser, K3OutputParser, ParsedOutput, PlainOutputParser, ToolCall, ToolCallDelta, assemble,
    parser_for,
)
from deltaserve.tokenizer import load_tokenizer
from deltaserve.tools.presets import get_preset
from deltaserve.tools.tokenizer_files import write_tokenizer_files

SEEDS = range(6)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3_tok")
    write_tokenizer_files(path, "kimi_k3", 2048)
    return load_tokenizer(path), ModelConfig.from_dict(get_preset("k31-tiny").config)


@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    path = tmp_path_factory.mktemp("k2_tok")
    write_tokenizer_files(path, "kimi_linear", 2048)
    return load_tokenizer(path), ModelConfig.from_dict(get_preset("kimi-linear-tiny").config)


ARGS1 = {"city": 'Paris "Île"\n<|close|>argument<|sep|> & more', "days": 2, "ratio": -0.25, "metric": True,
         "unit": None, "opts": {"b": [1, {"c": "ü"}], "a": "x"}, "tags": ["a", 3, False]}
ARGS2 = {"q": "中文 query 😀", "n": 10}
PROMPT = [{"role": "user", "content": "Weather?"}]


def assistant_turn(**over):
    m = {"role": "assistant", "reasoning_content": "Let me think: 中文 and <|open|>think<|sep|> literally.",
         "content": "Calling <|close|>response<|sep|> tools é.",
         "tool_calls": [{"id": "x1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS1}},
                        {"id": "x2", "type": "function",
                         "function": {"name": 'se"a&rch', "arguments": json.dumps(ARGS2, ensure_ascii=False)}}]}
    m.update(over)
    return m


def output_ids(tok, config, turn, thinking=True):
    """Ids the model would generate for `turn`: the rendered turn minus its prompt, plus the stop token."""
    prompt = render_chat(tok, config, PROMPT, thinking=thinking)
    full = render_chat(tok, config, PROMPT + [turn], thinking=thinking, add_generation_prompt=False)
    assert full[:len(prompt)] == prompt  # the generation prompt is a prefix of the rendered turn
    out = full[len(prompt):]
    assert out[-1] == tok.token_to_id("<|end_of_msg|>")
    return out


def compact(value):
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def expected_calls():
    return [ToolCall("functions.get_weather:0", "get_weather", compact(ARGS1)),
            ToolCall('functions.se"a&rch:1', 'se"a&rch', compact(ARGS2))]


def stream_all(parser, ids, rng=None, thinking=True, stream_arguments=False):
    """Feed ids in random-sized pieces (one at a time without rng); return all deltas incl. finish()."""
    sp = parser.stream(thinking, stream_arguments=stream_arguments)
    deltas, i = [], 0
    while i < len(ids):
        n = 1 if rng is None else rng.randint(1, 7)
        deltas += sp.feed(ids[i:i + n])
        i += n
    return deltas + sp.finish()


def check_streams(parser, ids, expected, thinking=True, both_modes=True):
    for mode in ((False, True) if both_modes else (False,)):
        assert assemble(stream_all(parser, ids, None, thinking, mode)) == expected
        for seed in SEEDS:
            assert assemble(stream_all(parser, ids, random.Random(seed), thinking, mode)) == expected


# ------------------------------------------------------------------------------------------------------ K3
def test_k3_round_trip(k3):
    tok, config = k3
    ids = output_ids(tok, config, assistant_turn())
    parser = K3OutputParser(tok)
    parsed = parser.parse(ids)
    assert parsed.reasoning_content == "Let me think: 中文 and <|open|>think<|sep|> literally."
    assert parsed.content == "Calling <|close|>response<|sep|> tools é."
    assert parsed.tool_calls == expected_calls()
    assert [json.loads(c.arguments_json) for c in parsed.tool_calls] == [ARGS1, ARGS2]
    assert list(json.loads(parsed.tool_calls[0].arguments_json)) == list(ARGS1)  # argument order kept
    assert 0 < parsed.reasoning_tokens < len(ids)
    assert parsed.tool_calls[0].to_openai()["function"]["name"] == "get_weather"
    # Immune to what follows the stop token.
    assert parser.parse(ids + tok.encode("junk")) == parsed
    # ... and to the ids being given as any iterable.
    assert parser.parse(iter(ids)) == parsed


def test_k3_streaming_matches_parse(k3):
    tok, config = k3
    ids = output_ids(tok, config, assistant_turn())
    parser = K3OutputParser(tok)
    check_streams(parser, ids, parser.parse(ids))


def test_k3_stream_delta_shapes(k3):
    tok, config = k3
    ids = output_ids(tok, config, assistant_turn())
    parser = K3OutputParser(tok)
    deltas = stream_all(parser, ids)
    # Reasoning before content before tool calls; each call arrives whole, once, after its close marker.
    kinds = [("r" if d.reasoning_content is not None else "c" if d.content is not None else "t") for d in deltas]
    assert kinds == sorted(kinds, key="rct".index)
    calls = [tc for d in deltas for tc in d.tool_calls]
    assert [(tc.index, tc.id, tc.name) for tc in calls] == [(0, "functions.get_weather:0", "get_weather"),
                                                            (1, 'functions.se"a&rch:1', 'se"a&rch')]
    # stream_arguments: the first delta of a call carries index, id and name; later ones only argument fragments.
    deltas = stream_all(parser, ids, stream_arguments=True)
    calls = [tc for d in deltas for tc in d.tool_calls]
    assert calls[0] == ToolCallDelta(0, "functions.get_weather:0", "get_weather", "")
    assert all(tc.id is None and tc.name is None for tc in calls if tc.index == 0 and tc is not calls[0])
    assert len([tc for tc in calls if tc.index == 0]) > 5  # really streamed in pieces
    wire = Delta(tool_calls=[calls[0]]).to_openai()
    assert wire == {"tool_calls": [{"index": 0, "id": "functions.get_weather:0", "type": "function",
                                    "function": {"name": "get_weather", "arguments": ""}}]}
    assert Delta(content="x").to_openai() == {"content": "x"}


def test_k3_thinking_disabled(k3):
    tok, config = k3
    ids = output_ids(tok, config, assistant_turn(), thinking=False)
    parser = K3OutputParser(tok)
    parsed = parser.parse(ids, thinking=False)
    assert parsed == ParsedOutput(None, "Calling <|close|>response<|sep|> tools é.", expected_calls())
    assert parsed.reasoning_tokens == 0
    check_streams(parser, ids, parsed, thinking=False)
    # No tools, thinking off: the whole response body is content.
    ids = output_ids(tok, config, {"role": "assistant", "content": "Just text."}, thinking=False)
    assert parser.parse(ids, thinking=False) == ParsedOutput(None, "Just text.", [])


def test_k3_no_tools_and_empty_think(k3):
    tok, config = k3
    parser = K3OutputParser(tok)
    ids = output_ids(tok, config, {"role": "assistant", "content": "Plain answer."})
    assert parser.parse(ids) == ParsedOutput(None, "Plain answer.", [])
    ids = output_ids(tok, config, {"role": "assistant", "content": "", "reasoning_content": "only thoughts"})
    assert parser.parse(ids) == ParsedOutput("only thoughts", "", [])


def test_k3_zero_length_think(k3):
    """SGLang: a response marker seen while in reasoning ends the reasoning (docs/chat.md §3.5)."""
    tok, _ = k3
    o, c, s = (tok.token_to_id(n) for n in ("<|open|>", "<|close|>", "<|sep|>"))
    eom = tok.token_to_id("<|end_of_msg|>")
    ids = ([o] + tok.encode("response") + [s] + tok.encode("Hi there") + [c] + tok.encode("response") + [s]
           + [c] + tok.encode("message") + [s, eom])
    parser = K3OutputParser(tok)
    assert parser.parse(ids) == ParsedOutput(None, "Hi there", [])
    check_streams(parser, ids, parser.parse(ids))


def test_k3_truncated_output_every_prefix(k3):
    """max_tokens mid-output: no crash; complete calls only; content kept; streams agree with parse."""
    tok, config = k3
    ids = output_ids(tok, config, assistant_turn())
    parser = K3OutputParser(tok)
    full = parser.parse(ids)
    close_call = tok.encode("call")
    rng = random.Random(0)
    seen_counts = set()
    for cut in range(len(ids) + 1):
        prefix = ids[:cut]
        parsed = parser.parse(prefix)
        # Every call reported is one of the complete calls, in order, and only once its close marker is in.
        assert parsed.tool_calls == full.tool_calls[:len(parsed.tool_calls)]
        n_closed = sum(1 for i in range(cut - len(close_call) - 1)
                       if prefix[i] == tok.token_to_id("<|close|>") and prefix[i + 1:i + 1 + len(close_call)]
                       == close_call and i + 1 + len(close_call) < cut)
        assert len(parsed.tool_calls) == n_closed
        seen_counts.add(len(parsed.tool_calls))
        # A cut inside a multi-byte character shows as U+FFFD (as Tokenizer.decode does).
        assert full.content.startswith(parsed.content.rstrip("\ufffd"))
        assert (full.reasoning_content or "").startswith((parsed.reasoning_content or "").rstrip("\ufffd"))
        if cut % 7 == 0:
            assert assemble(stream_all(parser, prefix, rng)) == parsed
    assert seen_counts == {0, 1, 2}
    # Cut mid-argument of the second call: the first call and all content survive.
    cut = ids.index(tok.token_to_id("<|open|>"), len(ids) - 30)
    parsed = parser.parse(ids[:cut])
    assert parsed.content == full.content and parsed.tool_calls == full.tool_calls[:1]


def test_k3_history_json_fallback_and_unnamed_call(k3):
    tok, config = k3
    parser = K3OutputParser(tok)
    turn = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "a", "function": {"name": "raw", "arguments": "not json {"}},
                           {"id": "b", "function": {"name": "empty", "arguments": {}}}]}
    ids = output_ids(tok, config, turn, thinking=False)
    parsed = parser.parse(ids, thinking=False)
    assert parsed.tool_calls == [ToolCall("functions.raw:0", "raw", "not json {"),
                                 ToolCall("functions.empty:1", "empty", "{}")]
    check_streams(parser, ids, parsed, thinking=False)
    # A call without a tool attribute is dropped; a non-JSON value of a typed argument is kept as a string.
    o, c, s = (tok.token_to_id(n) for n in ("<|open|>", "<|close|>", "<|sep|>"))

    def el(header, body=None):
        return [o] + tok.encode(header) + [s] + ([] if body is None else tok.encode(body))

    def end(name):
        return [c] + tok.encode(name) + [s]

    ids = (tok.encode("ok") + end("response") + el("tools") + el('call index="1"') + end("call")
           + el('call tool="t" index="2"') + el('argument key="n" type="number"', "12x") + end("argument")
           + el('argument key="n" type="string"', "dup") + end("argument") + end("call") + end("tools"))
    parsed = parser.parse(ids, thinking=False)
    assert parsed == ParsedOutput(None, "ok", [ToolCall("functions.t:0", "t", '{"n":"12x"}')])
    check_streams(parser, ids, parsed, thinking=False)


def test_k3_malformed_structure(k3):
    tok, _ = k3
    parser = K3OutputParser(tok)
    o, c, s = (tok.token_to_id(n) for n in ("<|open|>", "<|close|>", "<|sep|>"))

    def el(header, body=""):
        return [o] + tok.encode(header) + [s] + tok.encode(body)

    def end(name):
        return [c] + tok.encode(name) + [s]

    # Thinking off: think markers are dropped and their text is content. An element opened inside an argument
    # body drops that call; the next call still parses. Stray separators carry nothing.
    ids = (el("think", "a") + end("think") + [s] + tok.encode("b") + end("response") + el("tools")
           + el('call tool="bad"') + el('argument key="k" type="string"', "unterminated")
           + el('call tool="good"') + el('argument key="k" type="array"', "[1]") + end("argument") + end("call")
           + end("tools") + end("message") + tok.encode("after the message"))
    parsed = parser.parse(ids, thinking=False)
    assert parsed == ParsedOutput(None, "ab", [ToolCall("functions.good:0", "good", '{"k":[1]}')])
    for seed in SEEDS:
        assert assemble(stream_all(parser, ids, random.Random(seed), thinking=False)) == parsed


def test_k3_custom_ids(k3):
    tok, config = k3
    parser = K3OutputParser(tok, make_id=lambda name, i: f"call_{i}")
    ids = output_ids(tok, config, assistant_turn())
    assert [c.id for c in parser.parse(ids).tool_calls] == ["call_0", "call_1"]


# ------------------------------------------------------------------------------------------------------ K2
def test_k2_round_trip_from_template(k2):
    tok, config = k2
    turn = {"role": "assistant", "content": "Let me check.",
            "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                           {"id": "functions.lookup.v2:1", "type": "function",
                            "function": {"name": "lookup.v2", "arguments": {"q": "中文"}}}]}
    prompt = render_chat(tok, config, PROMPT)
    full = render_chat(tok, config, PROMPT + [turn], add_generation_prompt=False)
    assert full[:len(prompt)] == prompt
    ids = full[len(prompt):]
    parser = parser_for(config, tok)
    assert isinstance(parser, K2OutputParser)
    parsed = parser.parse(ids, thinking=False)
    assert parsed == ParsedOutput(None, "Let me check.", [
        ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
        ToolCall("functions.lookup.v2:1", "lookup.v2", '{"q": "中文"}')])
    check_streams(parser, ids, parsed, thinking=False)


def test_k2_thinking_markers(k2):
    tok, _ = k2
    t = tok.token_to_id
    ids = ([t("<think>")] + tok.encode("Reason 中文.") + [t("</think>")] + tok.encode("Answer.")
           + [t("<|tool_calls_section_begin|>"), t("<|tool_call_begin|>")] + tok.encode("functions.f:0")
           + [t("<|tool_call_argument_begin|>")] + tok.encode('{"a": [1, 2]}') + [t("<|tool_call_end|>")]
           + [t("<|tool_call_begin|>")] + tok.encode(" functions.g:1 ") + [t("<|tool_call_argument_begin|>"),
                                                                           t("<|tool_call_end|>")]
           + [t("<|tool_calls_section_end|>")] + tok.encode("trailing dropped") + [t("<|im_end|>")])
    parser = K2OutputParser(tok)
    parsed = parser.parse(ids)
    assert parsed == ParsedOutput("Reason 中文.", "Answer.", [ToolCall("functions.f:0", "f", '{"a": [1, 2]}'),
                                                             ToolCall("functions.g:1", "g", "{}")])
    check_streams(parser, ids, parsed)
    # The tool-call section also ends reasoning; thinking off keeps everything as content.
    ids2 = tok.encode("thinking") + ids[ids.index(t("<|tool_calls_section_begin|>")):]
    assert parser.parse(ids2) == ParsedOutput("thinking", "", parsed.tool_calls)
    assert parser.parse(tok.encode("a") + [t("</think>")] + tok.encode("b"), thinking=False) == \
        ParsedOutput(None, "ab", [])
    # Truncated inside the second call's arguments: only the first call.
    cut = ids.index(t("<|tool_call_argument_begin|>"), ids.index(t("<|tool_call_end|>")))
    assert parser.parse(ids[:cut + 1]).tool_calls == parsed.tool_calls[:1]


def test_parser_for_families(k3, k2):
    tok3, cfg3 = k3
    tok2, cfg2 = k2
    assert isinstance(parser_for(cfg3, tok3), K3OutputParser)
    assert isinstance(parser_for(cfg2, tok2), K2OutputParser)
    assert isinstance(parser_for(SimpleNamespace(family="deepseek_v3"), tok2), PlainOutputParser)
    plain = PlainOutputParser(tok2)
    ids = tok2.encode("héllo") + [tok2.token_to_id("<|im_end|>")]
    assert plain.parse(ids) == ParsedOutput(None, "héllo", [])
    with pytest.raises(ValueError, match="K3 markers"):
        K3OutputParser(tok2)

