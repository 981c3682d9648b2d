"""tokenizer.json (docs/chat.md §1.8): the file make-model, train and the default model ship makes transformers'
`AutoTokenizer` encode and decode exactly as deltaserve does, and deltaserve loads a folder that has only a
tokenizer.json through the `tokenizers` library with the same ids, bytes and config fields."""

from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path

import pytest
import tiktoken
import tokenizers
from transformers import AutoTokenizer

from deltaserve.default_model import default_model_path
from deltaserve.tokenizer import (KIMI_PAT_STR, HFTokenizer, TiktokenTokenizer, Tokenizer, TokenizerError,
                                  load_tokenizer)
from deltaserve.tools import corpus
from deltaserve.tools.tokenizer_files import write_tokenizer_files
from deltaserve.tools.tokenizer_json import tokenizer_json, write_tokenizer_json
from tokenizer_strings import STRINGS

# (folder kind, what): each tokenizer family make-model writes, through a make-model checkpoint (so transformers
# also sees the model's config.json), a larger generated table whose seeded padding tokens make unusual merges, and
# the shipped default model.
FOLDERS = ["k31-tiny", "kimi-linear-tiny", "deepseek-v32-tiny", "kimi_linear-4096", "default_model"]


@pytest.fixture(scope="module")
def folders(make_checkpoint, tmp_path_factory) -> dict[str, Path]:
    out = {name: make_checkpoint(name) for name in FOLDERS[:3]}
    big = tmp_path_factory.mktemp("kimi_linear_4096")
    write_tokenizer_files(big, "kimi_linear", 4096, seed=3)
    out["kimi_linear-4096"] = big
    out["default_model"] = default_model_path()
    return out


def family_strings(tok: Tokenizer) -> list[str]:
    """Every special spelling of `tok`, run into text and into each other."""
    names = sorted(tok.special_tokens)
    return ["x" + "y ".join(names[i:i + 16]) + "\n" for i in range(0, len(names), 16)] + ["".join(names)]


def json_only_copy(folder: Path, dest: Path) -> Path:
    """`folder`'s tokenizer.json and tokenizer_config.json alone (no tiktoken.model)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(folder / name, dest / name)
    return dest


# ------------------------------------------------------------------------------------- transformers agrees
@pytest.mark.parametrize("name", FOLDERS)
def test_autotokenizer_encodes_and_decodes_as_deltaserve(folders, name):
    folder = folders[name]
    tok = load_tokenizer(folder)
    assert isinstance(tok, TiktokenTokenizer)
    hf = AutoTokenizer.from_pretrained(folder)
    assert hf.is_fast and len(hf) == tok.vocab_size
    for text in STRINGS + family_strings(tok):
        with_specials = tok.encode(text, allow_special=True)
        assert hf(text, add_special_tokens=False).input_ids == with_specials, text
        assert hf(text, add_special_tokens=False, split_special_tokens=True).input_ids == tok.encode(text), text
        assert hf.decode(with_specials) == tok.decode(with_specials) == text
        assert hf.decode(with_specials, skip_special_tokens=True) == tok.decode(with_specials,
                                                                                skip_special_tokens=True)
    rng = random.Random(0)  # random ids: partial UTF-8 sequences, specials anywhere
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        assert hf.decode(ids) == tok.decode(ids)
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    assert hf.convert_ids_to_tokens(list(range(tok.vocab_size))) == [tok.id_to_token(i)
                                                                    for i in range(tok.vocab_size)]
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id)
    assert None not in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id)
    assert hf.model_max_length == tok.model_max_length
    assert hf.chat_template == tok.chat_template
    assert (tok.chat_template is None) == (name in ("k31-tiny", "default_model"))  # K3's renderer is code


def test_autotokenizer_on_the_validation_text():
    """The default model's whole held-out text (93k tokens of Python) through transformers and deltaserve."""
    folder = default_model_path()
    tok = load_tokenizer(folder)
    hf = AutoTokenizer.from_pretrained(folder)
    text = corpus.validation_text()
    assert len(text) > 250_000 and max(len(run) for run in text.split()) < 25_000  # below Kimi's run cut
    assert hf(text, add_special_tokens=False).input_ids == tok.encode(text)


# ----------------------------------------------------------------------------- deltaserve on tokenizer.json
@pytest.mark.parametrize("name", FOLDERS)
def test_tokenizer_json_alone_loads_as_the_same_tokenizer(folders, name, tmp_path):
    ref = load_tokenizer(folders[name])
    tok = load_tokenizer(json_only_copy(folders[name], tmp_path))
    assert isinstance(tok, HFTokenizer) and isinstance(ref, TiktokenTokenizer)
    assert tok.vocab_size == ref.vocab_size and tok.special_tokens == ref.special_tokens
    for i in range(ref.vocab_size):
        assert tok.id_to_bytes(i) == ref.id_to_bytes(i)
        assert tok.id_to_token(i) == ref.id_to_token(i)
        assert tok.token_to_id(ref.id_to_token(i)) == i
        assert tok.is_special(i) == ref.is_special(i)
    for text in STRINGS + family_strings(ref):
        assert tok.encode(text) == ref.encode(text), text
        assert tok.encode(text, allow_special=True) == ref.encode(text, allow_special=True), text
    fields = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template", "model_max_length",
              "add_bos_token", "tokenizer_config")
    assert all(getattr(tok, f) == getattr(ref, f) for f in fields)
    assert tok.stop_token_ids(None) == ref.stop_token_ids(None) and tok.stop_token_ids(7) == ref.stop_token_ids(7)
    rng = random.Random(1)
    for skip in (False, True):
        for _ in range(100):
            ids = [rng.randrange(ref.vocab_size) for _ in range(rng.randrange(1, 30))]
            assert tok.decode_bytes(ids, skip) == ref.decode_bytes(ids, skip)
            dec = tok.incremental_decoder(skip_special_tokens=skip)
            assert "".join(dec.feed(i) for i in ids) + dec.flush() == ref.decode(ids, skip_special_tokens=skip)
    with pytest.raises(TokenizerError):
        tok.decode([ref.vocab_size])
    with pytest.raises(TokenizerError):
        tok.id_to_bytes(-1)


def test_tiktoken_model_is_preferred_and_neither_file_names_both(folders, tmp_path):
    assert isinstance(load_tokenizer(folders["kimi-linear-tiny"]), TiktokenTokenizer)
    with pytest.raises(TokenizerError, match=r"tiktoken\.model.*tokenizer\.json"):
        load_tokenizer(tmp_path)
    json_only = json_only_copy(folders["kimi-linear-tiny"], tmp_path / "json")
    (json_only / "tokenizer_config.json").unlink()  # optional beside tokenizer.json: no names, no template
    tok = load_tokenizer(json_only)
    assert tok.eos_token_id is None and tok.chat_template is None and tok.tokenizer_config == {}
    assert tok.encode("hello <|im_end|>", allow_special=True)[-1] == tok.special_tokens["<|im_end|>"]
    (json_only / "chat_template.jinja").write_text("{{ messages }}")
    assert load_tokenizer(json_only).chat_template == "{{ messages }}"


# ------------------------------------------------------------------------------------------ the writer
def test_written_file_is_deterministic_and_holds_the_kimi_split(folders, tmp_path):
    folder = json_only_copy(folders["kimi_linear-4096"], tmp_path)
    shutil.copyfile(folders["kimi_linear-4096"] / "tiktoken.model", folder / "tiktoken.model")
    before = (folder / "tokenizer.json").read_bytes()
    write_tokenizer_json(folder)
    assert (folder / "tokenizer.json").read_bytes() == before
    spec = json.loads(before)
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"] == {"Regex": KIMI_PAT_STR} and byte_level["use_regex"] is False
    assert spec["model"]["ignore_merges"] is True and spec["post_processor"] is None
    assert [t["id"] for t in spec["added_tokens"]] == list(range(4096, 4096 + 256))
    assert all(t["special"] and not t["normalized"] for t in spec["added_tokens"])


def test_shipped_default_model_file_is_current(tmp_path):
    """deltaserve/data/default_model/tokenizer.json is what the writer makes of the shipped tiktoken.model."""
    shipped = default_model_path()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(shipped / name, tmp_path / name)
    assert write_tokenizer_json(tmp_path).read_bytes() == (shipped / "tokenizer.json").read_bytes()


def _hand_ranks(*tokens: bytes) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for t in tokens:
        ranks[t] = len(ranks)
    return ranks


def _library(tok: TiktokenTokenizer) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json(tok)))


def test_merges_include_splits_whose_half_outranks_the_token():
    """`abc` (256) is reachable only as `ab` (257) + `c`: tiktoken merges that pair, so the merges list must hold it
    although `ab` ranks after `abc`; with only lower-ranked halves HF would stop at [ab, c, d]."""
    tok = TiktokenTokenizer(_hand_ranks(b"abc", b"ab"), {})
    assert tok.encode("abcd") == [256, ord("d")]
    lib = _library(tok)
    assert lib.encode("abcd", add_special_tokens=False).ids == [256, ord("d")]
    merges = json.loads(lib.to_str())["model"]["merges"]
    assert ["ab", "c"] in merges and ["a", "b"] in merges


def test_merge_order_matches_tiktoken_on_random_tables():
    """Random tables over three letters (tokens not built from each other, ranks in any order) against tiktoken on
    every string of up to 7 letters: the rank-ordered merges reproduce tiktoken's merging wherever pairs compete."""
    rng = random.Random(0)
    texts = ["".join(p) for n in range(2, 8) for p in itertools.product("abc", repeat=n)]
    for _ in range(12):
        extra = set()
        while len(extra) < 14:
            extra.add(bytes(rng.choice(b"abc") for _ in range(rng.randrange(2, 6))))
        order = sorted(extra)
        rng.shuffle(order)
        tok = TiktokenTokenizer(_hand_ranks(*order), {})
        lib = _library(tok)
        enc = tiktoken.Encoding("plain", pat_str=r"[\s\S]+", mergeable_ranks={tok.id_to_bytes(i): i
                                                                             for i in range(tok.num_bpe_ranks)},
                                special_tokens={})
        for text in texts:  # the Kimi split keeps a run of letters whole, so both see one piece
            assert lib.encode(text, add_special_tokens=False).ids == enc.encode_ordinary(text) == tok.encode(text)


def test_writer_refuses_what_hf_could_not_reproduce():
    no_x = {bytes([b]): i for i, b in enumerate(b for b in range(256) if b != ord("x"))}
    with pytest.raises(ValueError, match="0x78"):
        tokenizer_json(TiktokenTokenizer(no_x, {}))
    latin = TiktokenTokenizer(_hand_ranks(), {"added_tokens_decoder": {"256": {"content": "<|café|>"}}})
    with pytest.raises(ValueError, match="café"):
        tokenizer_json(latin)  # é is in the byte alphabet: HF's decoder would give the single byte 0xE9


# ------------------------------------------------------------------------------------ the Kimi regex in HF
def _tiktoken_split(text: str, pieces: list[str]) -> list[str]:
    """tiktoken's own split of `text`, read through a table whose multi-byte tokens are exactly `pieces`: tiktoken
    returns a regex match's token directly when the whole match is in the table, else single bytes."""
    ranks = {bytes([b]): b for b in range(256)}
    for p in pieces:
        ranks.setdefault(p.encode(), len(ranks))
    enc = tiktoken.Encoding("pieces", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    return [enc.decode_single_token_bytes(t).decode() for t in enc.encode_ordinary(text)]


def _hf_split(text: str) -> list[str]:
    split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(KIMI_PAT_STR), behavior="isolated")
    return [piece for piece, _ in split.pre_tokenize_str(text)]


@pytest.mark.parametrize("text,pieces", [
    ("中文English混合", ["中文", "English", "混合"]),  # \p{Han} runs, and letters && not Han
    ("北京市 Pascal", ["北京市", " Pascal"]),
    ("é中ü文", ["é", "中", "ü", "文"]),  # marks and Latin letters stop at Han only by the intersection
    ("Hello world's  \n\n  x", ["Hello", " world's", "  \n\n", " ", " x"]),
])
def test_oniguruma_reads_the_kimi_regex_as_tiktoken(text, pieces):
    assert _hf_split(text) == pieces == _tiktoken_split(text, pieces)


def test_oniguruma_and_tiktoken_split_every_code_point_alike():
    """Each code point of the Basic and Supplementary Multilingual Planes, and every 37th beyond, between letters,
    doubled before a digit and after Han: the Split pre-tokenizer and tiktoken cut the text at the same places."""
    points = [c for c in range(0x20000) if not 0xD800 <= c < 0xE000] + list(range(0x20000, 0x110000, 37))
    for start in range(0, len(points), 4096):
        text = "".join(f"a{chr(c)}b {chr(c)}{chr(c)}1 中{chr(c)}\n" for c in points[start:start + 4096])
        hf = _hf_split(text)
        assert _tiktoken_split(text, hf) == hf, hex(points[start])


# ------------------------------------------------------------------- foreign tokenizer.json files
def _spec(folder: Path) -> dict:
    return json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))


def _with_spec(dest: Path, spec: dict) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return dest


def test_added_tokens_decode_as_the_library_does(folders, tmp_path):
    """Added tokens beyond the specials, as other tokenizer.json files have them: a DeepSeek-style name (decoded
    from its UTF-8), a name spelt in the byte alphabet (decoded through it, as tokenizers does), one with a space,
    and a non-special one, which HF matches in text even with specials split, and does not skip."""
    spec = _spec(folders["kimi-linear-tiny"])
    n = len(spec["model"]["vocab"]) + 256
    names = ["<｜begin▁of▁sentence｜>", "<|é|>", "a b", "<|not_special|>"]
    for i, name in enumerate(names):
        spec["added_tokens"].append({"id": n + i, "content": name, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": name != "<|not_special|>"})
    folder = _with_spec(tmp_path, spec)
    tok = load_tokenizer(folder)
    lib = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = list(range(n - 3, n + len(names))) + tok.encode("text é")
    assert tok.decode(ids) == lib.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == lib.decode(ids, skip_special_tokens=True)
    assert tok.id_to_bytes(n) == names[0].encode() and tok.id_to_bytes(n + 1) == b"<|\xe9|>"
    assert tok.is_special(n) and not tok.is_special(n + 3) and "<|not_special|>" not in tok.special_tokens
    text = "x<|not_special|>y<｜begin▁of▁sentence｜>"
    lib.encode_special_tokens = True
    assert tok.encode(text) == lib.encode(text, add_special_tokens=False).ids
    assert n + 3 in tok.encode(text) and n not in tok.encode(text)
    assert tok.encode(text, allow_special=True)[-1] == n


def test_file_settings_that_would_change_ids_are_not_applied(folders, tmp_path):
    """A post-processor adding BOS, truncation and padding in the file: encode gives the text's ids alone."""
    spec = _spec(folders["kimi-linear-tiny"])
    ref = load_tokenizer(folders["kimi-linear-tiny"])
    bos = ref.bos_token_id
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "[BOS]", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"[BOS]": {"id": "[BOS]", "ids": [bos], "tokens": ["[BOS]"]}}}
    spec["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": ref.pad_token_id, "pad_type_id": 0, "pad_token": "[PAD]"}
    folder = _with_spec(tmp_path, spec)
    lib = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert lib.encode("hello world, again").ids[0] == bos  # the library would apply them
    tok = load_tokenizer(folder)
    assert tok.encode("hello world, again") == ref.encode("hello world, again")


@pytest.mark.parametrize("edit,message", [
    (lambda s: s["model"].update(type="WordPiece"), "model is 'WordPiece', not 'BPE'"),
    (lambda s: s.update(decoder={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                                 "split": True}), "decoder is 'Metaspace', not 'ByteLevel'"),
    (lambda s: s.update(decoder=None), "decoder is None"),
    (lambda s: s["model"]["vocab"].update({"▁the": len(s["model"]["vocab"]) + 256}), "byte-level alphabet"),
])
def test_not_byte_level_bpe_is_refused(folders, tmp_path, edit, message):
    spec = _spec(folders["kimi-linear-tiny"])
    edit(spec)
    folder = _with_spec(tmp_path, spec)
    with pytest.raises(TokenizerError, match=message) as err:
        load_tokenizer(folder)
    assert "tokenizer.json" in str(err.value)


def test_malformed_files_name_the_file(folders, tmp_path):
    folder = _with_spec(tmp_path, {})
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not valid JSON"):
        load_tokenizer(folder)
    spec = _spec(folders["kimi-linear-tiny"])
    spec["model"]["merges"].append(["no-such", "tokens"])
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: the tokenizers library rejected it"):
        load_tokenizer(_with_spec(tmp_path, spec))


def test_ids_no_token_has_are_refused(folders, tmp_path):
    """A vocabulary with a gap: the library numbers added tokens after the count of vocabulary entries, so ids
    neither the vocabulary nor an added token has stay; they are outside the vocabulary, like ids past its end."""
    spec = _spec(folders["kimi-linear-tiny"])
    count = len(spec["model"]["vocab"])
    spec["model"]["vocab"]["zzqq"] = count + 400
    tok = load_tokenizer(_with_spec(tmp_path, spec))
    assert tok.vocab_size == count + 401 and tok.decode([count + 400]) == "zzqq"
    assert tok.special_tokens["[BOS]"] == count + 1 and tok.decode([count + 1]) == "[BOS]"
    for hole in (count, count + 257, count + 399):
        with pytest.raises(TokenizerError, match=f"token id {hole} has no token"):
            tok.decode([hole])
        with pytest.raises(TokenizerError, match=f"token id {hole} has no token"):
            tok.id_to_token(hole)
