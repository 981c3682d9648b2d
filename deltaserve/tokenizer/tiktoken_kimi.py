"""Kimi tiktoken tokenizer (docs/chat.md §1): ``tiktoken.model`` BPE ranks + 256 special ids from
``tokenizer_config.json``.

Contract (beyond ``base.Tokenizer``'s):
* ids ``0 .. num_bpe_ranks-1`` are BPE tokens, ``num_bpe_ranks .. num_bpe_ranks+255`` are specials; named ones come
  from ``added_tokens_decoder``, the rest are ``<|reserved_token_{id}|>`` (§1.2).
* ``encode`` reproduces the reference chunking (§1.5). A special id's bytes are its name's UTF-8.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import tiktoken

from .base import Tokenizer, TokenizerError, byte_level_string, token_name

TIKTOKEN_FILE = "tiktoken.model"

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


class TiktokenTokenizer(Tokenizer):
    """Kimi tokenizer over in-memory ranks and a parsed ``tokenizer_config.json``."""

    def __init__(self, mergeable_ranks: dict[bytes, int], config: dict[str, Any], source: str = "<memory>") -> None:
        super().__init__(config, source)
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
            content = token_name(entry)
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
        self._bpe_strings: dict[str, int] | None = None  # built lazily by token_to_id

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def num_bpe_ranks(self) -> int:
        return self._num_bpe

    @property
    def vocab_size(self) -> int:
        return self._num_bpe + NUM_SPECIAL_TOKENS

    @property
    def special_tokens(self) -> dict[str, int]:
        """All 256 special names (named and reserved) -> id. A copy."""
        return dict(self._special_ids)

    # ---------------------------------------------------------------------------------------------- id <-> name
    def is_special(self, token_id: int) -> bool:
        return self._num_bpe <= token_id < self.vocab_size

    def token_to_id(self, name: str) -> int | None:
        special = self._special_ids.get(name)
        if special is not None:
            return special
        if self._bpe_strings is None:
            self._bpe_strings = {self.id_to_token(i): i for i in range(self._num_bpe)}
        return self._bpe_strings.get(name)

    def id_to_token(self, token_id: int) -> str:
        if self.is_special(token_id):
            return self._special_names[token_id]
        return byte_level_string(self.id_to_bytes(token_id))

    def id_to_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one id (a special id gives its name's UTF-8)."""
        self._check_ids([token_id])
        return self._enc.decode_single_token_bytes(token_id)

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

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """Concatenated token bytes; special ids give their names (or nothing when skipped)."""
        id_list = [int(i) for i in ids]
        self._check_ids(id_list)
        if skip_special_tokens:
            id_list = [i for i in id_list if i < self._num_bpe]
        return self._enc.decode_bytes(id_list)

    def __repr__(self) -> str:
        return (f"TiktokenTokenizer(source={self._source!r}, num_bpe_ranks={self._num_bpe}, "
                f"vocab_size={self.vocab_size})")


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
