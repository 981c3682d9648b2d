"""Kimi tiktoken tokenizer (docs/chat.md §1): ``tiktoken.model`` BPE ranks + 256 special ids from
``tokenizer_config.json``.

Contract:
* ids ``0 .. num_bpe_ranks-1`` are BPE tokens, ``num_bpe_ranks .. num_bpe_ranks+255`` are specials; named ones come
  from ``added_tokens_decoder``, the rest are ``<|reserved_token_{id}|>`` (§1.2).
* ``encode`` reproduces the reference chunking (§1.5) and, by default, encodes special spellings as ordinary text.
* ``decode`` is byte-level; invalid UTF-8 becomes U+FFFD. ``IncrementalDecoder`` is the streaming form of it.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import operator
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import tiktoken

from deltaserve.errors import DeltaserveError

# The split regex of tokenization_kimi.py, verbatim (docs/chat.md §1.4). `&&` is class intersection, which fancy-regex
# (tiktoken's engine) understands; Python's `re` does not, so never compile this with `re`.
KIMI_PAT_STR: str = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_SPECIAL_TOKENS: int = 256
MAX_ENCODE_CHARS: int = 400_000  # tokenization_kimi.py TIKTOKEN_MAX_ENCODE_CHARS
MAX_RUN_CHARS: int = 25_000  # tokenization_kimi.py MAX_NO_WHITESPACES_CHARS

# Python's `\s` on str patterns uses the same predicate as str.isspace(), which the reference splitter uses.
_RUN_RE = re.compile(r"\s+|\S+")


class TokenizerError(DeltaserveError, ValueError):
    """A tokenizer file is missing or malformed, or an id is outside the vocabulary. The message names the file/id."""


def reserved_token_name(token_id: int) -> str:
    """Name of an unnamed special id (absolute id, as in tokenization_kimi.py)."""
    return f"<|reserved_token_{token_id}|>"


def split_for_encoding(text: str) -> Iterator[str]:
    """Yield the pieces the reference encodes independently (docs/chat.md §1.5).

    Cut into 400,000-char chunks; inside each, a run of whitespace or of non-whitespace longer than 25,000 chars
    is cut every 25,000 chars (the counter restarts when the whitespace class flips). Always yields at least once.
    """
    for start in range(0, max(len(text), 1), MAX_ENCODE_CHARS):
        chunk = text[start : start + MAX_ENCODE_CHARS]
        if len(chunk) <= MAX_RUN_CHARS:  # no run can exceed the limit; skip the scan
            yield chunk
            continue
        piece_start = 0
        for run in _RUN_RE.finditer(chunk):
            cut = run.start() + MAX_RUN_CHARS
            while cut < run.end():
                yield chunk[piece_start:cut]
                piece_start = cut
                cut += MAX_RUN_CHARS
        yield chunk[piece_start:]


def _token_name(value: Any) -> str | None:
    """HF configs store bos/eos/... either as a string or as an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable char map; HF's convert_ids_to_tokens shows BPE tokens this way (tokenization_kimi)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class Tokenizer:
    """Kimi tokenizer over in-memory ranks and a parsed ``tokenizer_config.json`` (use ``load_tokenizer``)."""

    def __init__(self, mergeable_ranks: dict[bytes, int], config: dict[str, Any], source: str = "<memory>") -> None:
        self._source = source
        self._num_bpe = len(mergeable_ranks)
        named: dict[int, str] = {}
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise TokenizerError(f"{source}: added_tokens_decoder must be an object")
        for key, entry in decoder.items():
            try:
                token_id = int(key)
            except ValueError:
                raise TokenizerError(f"{source}: added_tokens_decoder key {key!r} is not an integer id") from None
            content = _token_name(entry)
            if content is None:
                raise TokenizerError(f"{source}: added_tokens_decoder[{key}] has no string 'content'")
            # The reference only reads ids inside the special range; mirror that and ignore the rest.
            if self._num_bpe <= token_id < self._num_bpe + NUM_SPECIAL_TOKENS:
                named[token_id] = content
        self._special_names: dict[int, str] = {
            i: named.get(i, reserved_token_name(i)) for i in range(self._num_bpe, self._num_bpe + NUM_SPECIAL_TOKENS)
        }
        self._special_ids: dict[str, int] = {name: i for i, name in self._special_names.items()}
        if len(self._special_ids) != NUM_SPECIAL_TOKENS:
            raise TokenizerError(f"{source}: added_tokens_decoder names two ids with the same content")
        try:
            self._enc = tiktoken.Encoding(
                name=f"kimi:{source}",
                pat_str=KIMI_PAT_STR,
                mergeable_ranks=mergeable_ranks,
                special_tokens=self._special_ids,
                explicit_n_vocab=self.vocab_size,
            )
        except (AssertionError, ValueError) as exc:
            raise TokenizerError(f"{source}: tiktoken rejected the vocabulary: {exc}") from exc
        self._bos = _token_name(config.get("bos_token"))
        self._eos = _token_name(config.get("eos_token"))
        self._pad = _token_name(config.get("pad_token"))
        self._unk = _token_name(config.get("unk_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # HF also allows [{"name": ..., "template": ...}]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self._chat_template: str | None = template if isinstance(template, str) else None
        self.model_max_length: int | None = config.get("model_max_length")
        self.add_bos_token: bool = bool(config.get("add_bos_token", False))
        self._bpe_strings: dict[str, int] | None = None  # built lazily by token_to_id

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def num_bpe_ranks(self) -> int:
        return self._num_bpe

    @property
    def vocab_size(self) -> int:
        return self._num_bpe + NUM_SPECIAL_TOKENS

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
    def special_tokens(self) -> dict[str, int]:
        """All 256 special names (named and reserved) -> id. A copy."""
        return dict(self._special_ids)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    # ---------------------------------------------------------------------------------------------- id <-> name
    def is_special(self, token_id: int) -> bool:
        return self._num_bpe <= token_id < self.vocab_size

    def token_to_id(self, name: str) -> int | None:
        """Special name -> id; otherwise a BPE token in HF's byte-level string form (as ``id_to_token`` returns)."""
        special = self._special_ids.get(name)
        if special is not None:
            return special
        if self._bpe_strings is None:
            self._bpe_strings = {self.id_to_token(i): i for i in range(self._num_bpe)}
        return self._bpe_strings.get(name)

    def id_to_token(self, token_id: int) -> str:
        """Special ids -> their name; BPE ids -> HF byte-level string form (lossless, one char per byte)."""
        if self.is_special(token_id):
            return self._special_names[token_id]
        table = _BYTE_CHARS
        return "".join(table[b] for b in self.id_to_bytes(token_id))

    def id_to_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one id (a special id gives its name's UTF-8)."""
        self._check_ids([token_id])
        return self._enc.decode_single_token_bytes(token_id)

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
        doc_eos = self._special_ids.get("[EOS]")
        if doc_eos is not None:
            ids.append(doc_eos)
        return list(dict.fromkeys(ids))

    # -------------------------------------------------------------------------------------------- encode/decode
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Text -> ids with the reference chunking. Special spellings are plain text unless ``allow_special``."""
        out: list[int] = []
        for piece in split_for_encoding(text):
            if allow_special:
                out.extend(self._enc.encode(piece, allowed_special="all"))
            else:
                out.extend(self._enc.encode_ordinary(piece))
        return out

    def _check_ids(self, ids: list[int]) -> None:
        limit = self.vocab_size
        for i in ids:
            if not 0 <= i < limit:
                raise TokenizerError(f"token id {i} is outside the vocabulary [0, {limit}) of {self._source}")

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """Concatenated token bytes; special ids give their names (or nothing when skipped)."""
        id_list = [int(i) for i in ids]
        self._check_ids(id_list)
        if skip_special_tokens:
            id_list = [i for i in id_list if i < self._num_bpe]
        return self._enc.decode_bytes(id_list)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Byte-level decode; invalid UTF-8 (including a truncated trailing character) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer(source={self._source!r}, num_bpe_ranks={self._num_bpe}, vocab_size={self.vocab_size})"


_BYTE_CHARS: dict[int, str] = _bytes_to_unicode()


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


# ---------------------------------------------------------------------------------------------------- loading
def read_tiktoken_model(path: str | Path) -> dict[bytes, int]:
    """Parse ``base64(bytes) SP rank`` lines; ranks must be exactly 0..n-1 with distinct tokens."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file not found: {path}") from None
    except OSError as exc:
        raise TokenizerError(f"cannot read tokenizer file {path}: {exc}") from exc
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("expected 'base64 rank'")
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
        except (ValueError, binascii.Error) as exc:
            raise TokenizerError(f"{path}:{lineno}: malformed line ({exc})") from None
        if token in ranks:
            raise TokenizerError(f"{path}:{lineno}: token {token!r} appears twice")
        ranks[token] = rank
    if not ranks:
        raise TokenizerError(f"{path}: no BPE ranks")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks are not exactly 0..{len(ranks) - 1}")
    return ranks


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load ``tiktoken.model`` + ``tokenizer_config.json`` (+ ``chat_template.jinja`` if the config has none)."""
    folder = Path(path)
    ranks = read_tiktoken_model(folder / "tiktoken.model")
    config_path = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file not found: {config_path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{config_path}: not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise TokenizerError(f"{config_path}: top level must be an object")
    template_path = folder / "chat_template.jinja"
    if config.get("chat_template") is None and template_path.is_file():
        config = {**config, "chat_template": template_path.read_text(encoding="utf-8")}
    return Tokenizer(ranks, config, source=str(config_path))
