"""Tokenizer (docs/chat.md §1) on generated real-layout tokenizer files for each family."""

from __future__ import annotations

import random
import time
from pathlib import Path

import jinja2.sandbox
import pytest
import tiktoken

from deltaserve.tokenizer import (
    KIMI_PAT_STR,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    read_tiktoken_model,
    split_for_encoding,
)
from deltaserve.tools.tokenizer_files import SAMPLE_CORPUS, special_token_offsets, write_tokenizer_files

SIZES = {"kimi_k3": 1024, "kimi_linear": 512, "deepseek": 777}
ROUND_TRIP = [
    "",
    "Hello, world! It's 2024 and we're testing 1234567 tokens.",
    "北京市是中国的首都，人工智能正在改变世界。",
    "Emoji 😀🎉👍🏽 ❤️ and a rare clef 𝄞 plus ZWJ 👨‍👩‍👧",
    'def f(x: int) -> int:\n\treturn x ** 2  # square\n\n{"a": [1, 2, {"b": null}]}',
    "   leading, trailing   \n\n\n\t\t  \r\n  \u3000\u00a0 ",
    "Ünïcödé Straße Ελληνικά русский 日本語 한국어 e\u0301",
]


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    out = {}
    for family, n in SIZES.items():
        folder = tmp_path_factory.mktemp(family)
        assert write_tokenizer_files(folder, family, n) == n
        out[family] = load_tokenizer(folder)
    return out


@pytest.mark.parametrize("family", SIZES)
@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(toks: dict[str, Tokenizer], family: str, text: str) -> None:
    tok = toks[family]
    ids = tok.encode(text)
    assert all(0 <= i < tok.num_bpe_ranks for i in ids)
    assert tok.decode(ids) == text


def test_layout_and_reachability(tmp_path: Path) -> None:
    start = time.perf_counter()
    write_tokenizer_files(tmp_path, "kimi_k3", 4096)
    assert time.perf_counter() - start < 5.0
    ranks = read_tiktoken_model(tmp_path / "tiktoken.model")
    assert len(ranks) == 4096
    by_rank = sorted(ranks, key=ranks.__getitem__)
    assert by_rank[:256] == [bytes([b]) for b in range(256)]
    enc = tiktoken.Encoding("check", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    # Every token is what tiktoken's BPE produces for its own bytes, i.e. no dead (unreachable) merges.
    assert all(enc._encode_single_piece(tok) == [rank] for tok, rank in ranks.items())
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 4096 + 256 and tok.num_bpe_ranks == 4096
    assert tok.encode(SAMPLE_CORPUS) == enc.encode_ordinary(SAMPLE_CORPUS)


@pytest.mark.parametrize("family", SIZES)
def test_named_special_ids(toks: dict[str, Tokenizer], family: str) -> None:
    tok = toks[family]
    n = tok.num_bpe_ranks
    for name, offset in special_token_offsets(family).items():
        assert tok.token_to_id(name) == n + offset
        assert tok.id_to_token(n + offset) == name
        assert tok.is_special(n + offset)
        assert tok.encode(name, allow_special=True) == [n + offset]
    assert tok.bos_token_id == n and tok.pad_token_id == n + 255 and tok.unk_token_id == n + 254
    assert tok.eos_token_id == n + 2  # <|end_of_msg|> (K3) and <|im_end|> (K2 family) share offset 2
    assert len(tok.special_tokens) == 256 and not tok.is_special(n - 1) and not tok.is_special(n + 256)


def test_family_tables(toks: dict[str, Tokenizer]) -> None:
    k3, k2 = toks["kimi_k3"], toks["kimi_linear"]
    n3, n2 = k3.num_bpe_ranks, k2.num_bpe_ranks
    assert k3.token_to_id("<|end_of_msg|>") == n3 + 2 and k3.token_to_id("<|open|>") == n3 + 3
    assert k3.token_to_id("<|sep|>") == n3 + 5 and k3.token_to_id("<osagent_mode>") == n3 + 65
    assert k3.token_to_id("<|im_end|>") is None
    assert k2.token_to_id("<|im_end|>") == n2 + 2 and k2.token_to_id("<|im_middle|>") == n2 + 17
    assert k2.token_to_id("<think>") == n2 + 22 and k2.token_to_id("</think>") == n2 + 23
    assert k2.token_to_id("<|open|>") is None
    assert k3.chat_template is None and k2.chat_template is not None


def test_reserved_names(toks: dict[str, Tokenizer]) -> None:
    tok = toks["kimi_k3"]
    n = tok.num_bpe_ranks
    for i in (n + 8, n + 10, n + 64, n + 253):
        name = f"<|reserved_token_{i}|>"
        assert tok.id_to_token(i) == name and tok.token_to_id(name) == i
        assert tok.decode([i]) == name
    assert tok.encode(f"<|reserved_token_{n + 8}|>", allow_special=True) == [n + 8]


def test_literal_specials_are_text_by_default(toks: dict[str, Tokenizer]) -> None:
    tok = toks["kimi_k3"]
    n = tok.num_bpe_ranks
    text = 'user says <|open|>message role="system"<|sep|> and <|end_of_msg|>'
    plain = tok.encode(text)
    assert all(i < n for i in plain) and tok.decode(plain) == text
    special = tok.encode(text, allow_special=True)
    assert n + 3 in special and n + 5 in special and n + 2 in special
    assert tok.decode(special) == text


def test_skip_special_tokens(toks: dict[str, Tokenizer]) -> None:
    tok = toks["kimi_k3"]
    n = tok.num_bpe_ranks
    ids = [n + 3] + tok.encode("message") + [n + 5] + tok.encode("hi") + [n + 100, n + 2]
    assert tok.decode(ids) == f"<|open|>message<|sep|>hi<|reserved_token_{n + 100}|><|end_of_msg|>"
    assert tok.decode(ids, skip_special_tokens=True) == "messagehi"
    with pytest.raises(TokenizerError):
        tok.decode([n + 256])
    with pytest.raises(TokenizerError):
        tok.decode([-1])


def _piece_encoding(pieces: list[str]) -> tiktoken.Encoding:
    """An encoding whose only multi-byte tokens are whole candidate pieces: tiktoken returns a piece's token
    directly when the whole regex match is in the table, so the output lists exactly tiktoken's own split."""
    ranks = {bytes([b]): b for b in range(256)}
    for p in pieces:
        ranks.setdefault(p.encode(), len(ranks))
    return tiktoken.Encoding("pieces", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})


@pytest.mark.parametrize(
    "text,pieces",
    [
        ("中文English混合", ["中文", "English", "混合"]),
        ("北京市 Pascal", ["北京市", " Pascal"]),
        ("Hello world's  \n\n  x", ["Hello", " world's", "  \n\n", " ", " x"]),
    ],
)
def test_split_regex(toks: dict[str, Tokenizer], text: str, pieces: list[str]) -> None:
    decoys = ["中文English", "English混合", "中文English混合", "北京市 ", "北京市 Pascal", "Hello world's"]
    enc = _piece_encoding(pieces + decoys)
    assert [enc.decode_single_token_bytes(t).decode() for t in enc.encode_ordinary(text)] == pieces
    tok = toks["kimi_linear"]
    assert tok.encode(text) == [i for p in pieces for i in tok.encode(p)]


def test_training_split_matches_tiktoken() -> None:
    """The regex-module (V1) splitter used for training agrees with tiktoken's splitter on the sample corpus."""
    import regex

    pieces = regex.findall(r"(?V1)" + KIMI_PAT_STR, SAMPLE_CORPUS)
    enc = _piece_encoding(pieces)
    got = [enc.decode_single_token_bytes(t).decode() for t in enc.encode_ordinary(SAMPLE_CORPUS)]
    assert got == pieces


def test_split_for_encoding_rule() -> None:
    assert [len(p) for p in split_for_encoding("a" * 60_000)] == [25_000, 25_000, 10_000]
    assert [len(p) for p in split_for_encoding(" " * 25_001 + "x")] == [25_000, 2]
    assert list(split_for_encoding("a" * 20_000 + " " + "b" * 20_000)) == ["a" * 20_000 + " " + "b" * 20_000]
    assert list(split_for_encoding("")) == [""]
    long = "abc " * 110_000  # 440,000 chars: cut at 400,000 even though no run is long
    assert [len(p) for p in split_for_encoding(long)] == [400_000, 40_000]


def test_chunking_changes_ids(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path, "kimi_k3", 300, corpus="abc abcabc abc xabc abcabcabc " * 20)
    tok = load_tokenizer(tmp_path)
    a_run = "a" * 60_000
    assert tok.encode(a_run) == tok.encode("a" * 25_000) * 2 + tok.encode("a" * 10_000)
    abc_run = "abc" * 20_000  # the 25,000-char cut lands inside an "abc" token
    chunked = tok.encode(abc_run)
    assert chunked == [i for p in ("abc" * 8333 + "a", "bc" + "abc" * 8332 + "ab", "c" + "abc" * 3333)
                       for i in tok.encode(p)]  # fmt: skip
    assert chunked != tok._enc.encode_ordinary(abc_run)  # proves the rule is applied, not incidental
    assert tok.decode(chunked) == abc_run
    long = "word " * 90_000  # 450,000 chars
    assert tok.encode(long) == tok.encode(long[:400_000]) + tok.encode(long[400_000:])


def test_incremental_decoder(toks: dict[str, Tokenizer]) -> None:
    tok = toks["kimi_k3"]
    text = "a𝄞b中"
    ids = tok.encode(text)
    clef = tok.encode("𝄞")
    assert len(clef) > 1  # the rare 4-byte char is split across byte tokens
    dec = tok.incremental_decoder()
    outs = [dec.feed(i) for i in ids]
    assert "".join(outs) + dec.flush() == text
    assert all("\ufffd" not in o for o in outs)
    dec = tok.incremental_decoder()
    assert dec.feed(clef[:-1]) == "" and dec.feed(clef[-1:]) == "𝄞"
    assert dec.feed(clef[:1]) == "" and dec.flush() == "\ufffd"  # truncated at end of stream


def test_incremental_matches_decode_on_random_ids(toks: dict[str, Tokenizer]) -> None:
    tok = toks["kimi_k3"]
    rng = random.Random(0)
    for skip in (False, True):
        for _ in range(50):
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
            dec = tok.incremental_decoder(skip_special_tokens=skip)
            streamed = "".join(dec.feed(i) for i in ids) + dec.flush()
            assert streamed == tok.decode(ids, skip_special_tokens=skip)


def test_token_strings_round_trip(toks: dict[str, Tokenizer]) -> None:
    tok = toks["kimi_linear"]
    for i in (0, 32, 200, 255, 256, tok.num_bpe_ranks - 1):
        assert tok.token_to_id(tok.id_to_token(i)) == i
    assert tok.id_to_token(tok.encode(" the")[0]) == "Ġthe"


def test_stop_token_ids(toks: dict[str, Tokenizer]) -> None:
    k3 = toks["kimi_k3"]
    n = k3.num_bpe_ranks
    assert k3.stop_token_ids(n + 2) == [n + 2, n + 1]
    assert k3.stop_token_ids([n + 2, n + 1]) == [n + 2, n + 1]
    assert k3.stop_token_ids(None) == [n + 2, n + 1]


def test_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tiktoken.model"):
        load_tokenizer(tmp_path)
    write_tokenizer_files(tmp_path, "kimi_linear", 300)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)
    write_tokenizer_files(tmp_path, "kimi_linear", 300)
    with open(tmp_path / "tiktoken.model", "a") as f:
        f.write("not-base64!! x\n")
    with pytest.raises(TokenizerError, match=r"tiktoken.model:301"):
        load_tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYQ== 1\n")
    with pytest.raises(ValueError, match="twice"):
        load_tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYg== 2\n")
    with pytest.raises(TokenizerError, match="ranks"):
        load_tokenizer(tmp_path)
    write_tokenizer_files(tmp_path, "kimi_linear", 300)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="family"):
        write_tokenizer_files(tmp_path, "llama", 300)


def test_deterministic_files(tmp_path: Path) -> None:
    def files(name: str, seed: int) -> tuple[bytes, bytes]:
        write_tokenizer_files(tmp_path / name, "kimi_k3", 2048, seed=seed)
        folder = tmp_path / name
        return (folder / "tiktoken.model").read_bytes(), (folder / "tokenizer_config.json").read_bytes()

    first, again, other = files("a", 7), files("b", 7), files("c", 8)
    assert first == again
    assert first[0] != other[0]  # 2048 ranks exceed what the corpus teaches, so the seed picks the padding


def test_chat_template_sibling_file(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path, "kimi_k3", 300)
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert load_tokenizer(tmp_path).chat_template == "{{ messages }}"


def _render(template: str, **kwargs: object) -> str:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(**kwargs)


def test_k2_chat_template(toks: dict[str, Tokenizer]) -> None:
    tok = toks["kimi_linear"]
    template = tok.chat_template
    assert template is not None
    out = _render(template, messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "functions.get_weather:0", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temp": 18}'},
        {"role": "assistant", "content": "18 degrees."},
    ]
    out = _render(template, messages=messages, add_generation_prompt=False)
    assert out == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city":"Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{"temp": 18}<|im_end|>'
        "<|im_assistant|>assistant<|im_middle|>18 degrees.<|im_end|>"
    )
    ids = tok.encode(out, allow_special=True)
    n = tok.num_bpe_ranks
    assert ids[0] == n + 10 and ids.count(n + 2) == 5 and tok.decode(ids) == out
