"""A Hugging Face ``tokenizer.json`` (byte-level BPE, e.g. DeepSeek-V3's) behind deltaserve's tokenizer interface
(docs/chat.md §1.8).

Contract (beyond ``base.Tokenizer``'s): encoding is the ``tokenizers`` library's, token for token, with no
post-processor (no BOS) and no truncation or padding whatever the file asks. ``encode(text)`` is HF's
``split_special_tokens=True`` (added tokens marked ``special`` stay text; added tokens that are not special are
matched, as HF always matches them), ``encode(text, allow_special=True)`` is HF's default. Special tokens are the
added tokens marked ``special``. Per-id bytes are what the ByteLevel decoder gives: a vocabulary token through the
GPT-2 byte alphabet, an added token likewise when every char of it is in that alphabet, else its UTF-8. Only a BPE
model with a ByteLevel decoder whose vocabulary is spelt in the byte alphabet is accepted; anything else is a
``TokenizerError``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers

from .base import CHAR_TO_BYTE, Tokenizer, TokenizerError, byte_level_decode

TOKENIZER_JSON_FILE = "tokenizer.json"


def _check_byte_level(spec: Any, source: str) -> None:
    if not isinstance(spec, dict):
        raise TokenizerError(f"{source}: top level must be an object")
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    decoder = spec.get("decoder") if isinstance(spec.get("decoder"), dict) else {}
    if model.get("type") != "BPE":
        raise TokenizerError(f"{source}: the model is {model.get('type')!r}, not 'BPE'; deltaserve reads byte-level "
                             f"BPE tokenizer.json files only")
    if decoder.get("type") != "ByteLevel":
        raise TokenizerError(f"{source}: the decoder is {decoder.get('type')!r}, not 'ByteLevel'; deltaserve reads "
                             f"byte-level BPE tokenizer.json files only")


class HFTokenizer(Tokenizer):
    """A byte-level BPE ``tokenizer.json`` (its text) and a parsed ``tokenizer_config.json`` (``{}`` if absent)."""

    def __init__(self, tokenizer_json: str, config: dict[str, Any], source: str = "<memory>") -> None:
        super().__init__(config, source)
        try:
            spec = json.loads(tokenizer_json)
        except json.JSONDecodeError as exc:
            raise TokenizerError(f"{source}: not valid JSON: {exc}") from exc
        _check_byte_level(spec, source)
        try:
            # Two copies because `encode_special_tokens` is a property of the object, not of the call.
            self._matching = tokenizers.Tokenizer.from_str(tokenizer_json)
            self._as_text = tokenizers.Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the library raises plain Exception for every malformed field
            raise TokenizerError(f"{source}: the tokenizers library rejected it: {exc}") from exc
        for tok in (self._matching, self._as_text):
            tok.no_truncation()
            tok.no_padding()
        self._as_text.encode_special_tokens = True
        added = self._matching.get_added_tokens_decoder()
        vocab = self._matching.get_vocab(with_added_tokens=False)
        size = max([*vocab.values(), *added, -1]) + 1
        if size == 0:
            raise TokenizerError(f"{source}: the vocabulary is empty")
        self._bytes: list[bytes | None] = [None] * size  # None: an id no token has
        for text, token_id in vocab.items():
            bad = next((c for c in text if c not in CHAR_TO_BYTE), None)
            if bad is not None:
                raise TokenizerError(f"{source}: vocabulary token {text!r} (id {token_id}) has {bad!r}, which is "
                                     f"not in the byte-level alphabet; deltaserve reads byte-level BPE only")
            self._bytes[token_id] = bytes(CHAR_TO_BYTE[c] for c in text)
        for token_id, token in added.items():  # an added token overrides a vocabulary entry, as in HF's decode
            self._bytes[token_id] = byte_level_decode(token.content)
        self._special_ids: dict[str, int] = {t.content: i for i, t in sorted(added.items()) if t.special}
        self._special_set: frozenset[int] = frozenset(self._special_ids.values())

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special_ids)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_set

    def token_to_id(self, name: str) -> int | None:
        return self._matching.token_to_id(name)

    def id_to_token(self, token_id: int) -> str:
        self._check_ids([token_id])
        return self._matching.id_to_token(token_id)

    def id_to_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        return self._bytes[token_id]  # type: ignore[return-value]  # _check_ids refused the holes

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        tok = self._matching if allow_special else self._as_text
        return tok.encode(text, add_special_tokens=False).ids

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        id_list = [int(i) for i in ids]
        self._check_ids(id_list)
        if skip_special_tokens:
            id_list = [i for i in id_list if i not in self._special_set]
        return b"".join(self._bytes[i] for i in id_list)  # type: ignore[misc]

    def _check_ids(self, ids: list[int]) -> None:
        super()._check_ids(ids)
        for i in ids:
            if self._bytes[i] is None:
                raise TokenizerError(f"token id {i} has no token in {self._source}")

    def __repr__(self) -> str:
        return f"HFTokenizer(source={self._source!r}, vocab_size={self.vocab_size})"


def read_tokenizer_json(path: Path) -> str:
    """The text of a ``tokenizer.json``; a missing or unreadable file is a ``TokenizerError`` naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read tokenizer file {path}: {exc}") from exc
