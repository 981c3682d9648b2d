"""The tokenizer interface the rest of deltaserve uses (docs/chat.md §1), and what its implementations share.

Contract of every ``Tokenizer``:
* ``encode(text)`` treats special-token spellings as plain text; ``encode(text, allow_special=True)`` turns them
  into their ids. Neither adds BOS (``add_bos_token`` is only reported).
* ``id_to_bytes`` is exact per id; ``decode_bytes`` concatenates it; ``decode`` is UTF-8 with invalid bytes as U+FFFD
  and ``IncrementalDecoder`` is its streaming form. An id outside the vocabulary raises ``TokenizerError``.
* bos/eos/pad/unk, ``chat_template``, ``model_max_length`` and ``add_bos_token`` come from ``tokenizer_config.json``
  (kept whole as ``tokenizer_config``), whichever file holds the vocabulary.
"""

from __future__ import annotations

import codecs
import json
import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from deltaserve.errors import DeltaserveError

CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class TokenizerError(DeltaserveError, ValueError):
    """A tokenizer file is missing or malformed, or an id is outside the vocabulary. The message names the file/id."""


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable char map (byte-level BPE vocabularies spell their tokens with it; HF shows BPE
    tokens this way): printable Latin-1 bytes stand for themselves, the other 68 take chars from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_TO_CHAR: dict[int, str] = _gpt2_byte_chars()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}


def byte_level_string(data: bytes) -> str:
    """Bytes in the byte-level alphabet (one char per byte), as HF vocabularies and ``id_to_token`` spell them."""
    return "".join(BYTE_TO_CHAR[b] for b in data)


def byte_level_decode(text: str) -> bytes:
    """The bytes HF's ByteLevel decoder gives for one token string: the chars mapped back through the byte
    alphabet when all of them are in it, else the string's own UTF-8 (how it passes an added token like
    ``<｜begin▁of▁sentence｜>`` through)."""
    if all(c in CHAR_TO_BYTE for c in text):
        return bytes(CHAR_TO_BYTE[c] for c in text)
    return text.encode("utf-8")


def token_name(value: Any) -> str | None:
    """HF configs store bos/eos/... either as a string or as an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(folder: Path, required: bool) -> dict[str, Any]:
    """``tokenizer_config.json`` of ``folder`` as an object, with ``chat_template.jinja`` as its ``chat_template``
    when the JSON has none. A missing file is an error only when ``required`` (then ``{}`` is never returned)."""
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if required:
            raise TokenizerError(f"tokenizer file not found: {path}") from None
        config = {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: top level must be an object")
    template_path = folder / CHAT_TEMPLATE_FILE
    if config.get("chat_template") is None and template_path.is_file():
        config = {**config, "chat_template": template_path.read_text(encoding="utf-8")}
    return config


class Tokenizer(ABC):
    """A loaded vocabulary behind the interface above (use ``load_tokenizer``). Subclasses hold the vocabulary;
    this class holds what ``tokenizer_config.json`` says and the rules that follow from ids alone."""

    def __init__(self, config: dict[str, Any], source: str) -> None:
        self._source = source
        self.tokenizer_config: dict[str, Any] = config
        self._bos = token_name(config.get("bos_token"))
        self._eos = token_name(config.get("eos_token"))
        self._pad = token_name(config.get("pad_token"))
        self._unk = token_name(config.get("unk_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # HF also allows [{"name": ..., "template": ...}]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self._chat_template: str | None = template if isinstance(template, str) else None
        self.model_max_length: int | None = config.get("model_max_length")
        self.add_bos_token: bool = bool(config.get("add_bos_token", False))

    # ------------------------------------------------------------------------------------- the vocabulary
    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """One past the largest id."""

    @property
    @abstractmethod
    def special_tokens(self) -> dict[str, int]:
        """Every special token's spelling -> id. A copy."""

    @abstractmethod
    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (dropped by ``skip_special_tokens``)."""

    @abstractmethod
    def token_to_id(self, name: str) -> int | None:
        """A special spelling, or a BPE token in HF's byte-level string form (as ``id_to_token`` gives), -> id."""

    @abstractmethod
    def id_to_token(self, token_id: int) -> str:
        """Special ids -> their spelling; BPE ids -> HF's byte-level string form (lossless, one char per byte)."""

    @abstractmethod
    def id_to_bytes(self, token_id: int) -> bytes:
        """The exact bytes one id decodes to."""

    @abstractmethod
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Text -> ids. Special spellings are plain text unless ``allow_special``."""

    @abstractmethod
    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """Concatenated token bytes, without the special ids when ``skip_special_tokens``."""

    # ------------------------------------------------------------------------------ what the config names
    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self._bos) if self._bos else None

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self._eos) if self._eos else None

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self._pad) if self._pad else None

    @property
    def unk_token_id(self) -> int | None:
        return self.token_to_id(self._unk) if self._unk else None

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def stop_token_ids(self, config_eos_ids: int | Iterable[int] | None = None) -> list[int]:
        """Family stop ids (§1.7): the model config's eos id(s) plus ``[EOS]`` if named; duplicates removed.

        With no config ids, the tokenizer's own ``eos_token`` stands in for them.
        """
        if config_eos_ids is None:
            ids: list[int] = []
        elif isinstance(config_eos_ids, int):
            ids = [config_eos_ids]
        else:
            ids = [int(i) for i in config_eos_ids]
        if not ids and self.eos_token_id is not None:
            ids = [self.eos_token_id]
        doc_eos = self.special_tokens.get("[EOS]")
        if doc_eos is not None:
            ids.append(doc_eos)
        return list(dict.fromkeys(ids))

    # ------------------------------------------------------------------------------------------- decoding
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Byte-level decode; invalid UTF-8 (including a truncated trailing character) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    def _check_ids(self, ids: list[int]) -> None:
        limit = self.vocab_size
        for i in ids:
            if not 0 <= i < limit:
                raise TokenizerError(f"token id {i} is outside the vocabulary [0, {limit}) of {self._source}")


class IncrementalDecoder:
    """Streaming detokeniser: ``feed`` returns only newly complete text, holding back an unfinished UTF-8 sequence.

    The concatenation of every ``feed`` result plus ``flush()`` equals ``Tokenizer.decode`` of all ids fed.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Python's incremental UTF-8 decoder buffers incomplete tails and replaces invalid bytes exactly as the
        # one-shot bytes.decode(errors="replace") does, which is the equality this class promises.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: int | Iterable[int]) -> str:
        try:  # one id (int, numpy scalar, 0-d tensor) or an iterable of ids
            id_list = [operator.index(ids)]  # type: ignore[arg-type]
        except TypeError:
            id_list = list(ids)  # type: ignore[arg-type]
        return self._utf8.decode(self._tok.decode_bytes(id_list, self._skip), final=False)

    def flush(self) -> str:
        """End of stream: emit held-back bytes (as U+FFFD if they never completed) and reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
