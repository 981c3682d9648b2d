"""Write the Hugging Face ``tokenizer.json`` that encodes and decodes exactly as a Kimi ``tiktoken.model`` +
``tokenizer_config.json`` does (docs/chat.md §1.8), so tools that load ``AutoTokenizer.from_pretrained(folder)``
get deltaserve's ids.

What makes the two agree:
* merges: tiktoken merges, in a piece, the adjacent pair whose concatenation has the lowest rank (leftmost on a
  tie); HF merges the adjacent pair listed first in ``merges`` (leftmost on a tie). Listing every split of every
  token into two vocabulary tokens, ordered by the token's rank, gives both the same order. Every split, not only
  those into lower-ranked tokens: tiktoken also merges a pair one of whose halves outranks the result.
* ``ignore_merges``: a whole pre-token that is a vocabulary token is that token, as tiktoken returns it directly.
* pre-tokenizer: a Split on ``KIMI_PAT_STR`` (the tokenizers library reads it with Oniguruma, which has the same
  ``&&`` class intersection and ``\\p{Han}`` as tiktoken's fancy-regex), then ByteLevel without its own regex.
* the 256 special ids as added tokens (``special``, not normalised, no stripping) with their ids and names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..tokenizer import KIMI_PAT_STR, TOKENIZER_JSON_FILE, TiktokenTokenizer, load_tokenizer
from ..tokenizer.base import byte_level_decode, byte_level_string

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def _merges(ranks: dict[bytes, int]) -> list[list[str]]:
    """Every (left, right) split of every token into two vocabulary tokens, by the token's rank, then by split."""
    merges: list[list[str]] = []
    for token in sorted(ranks, key=ranks.__getitem__):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append([byte_level_string(left), byte_level_string(right)])
    return merges


def tokenizer_json(tok: TiktokenTokenizer) -> dict[str, Any]:
    """The ``tokenizer.json`` object equivalent to ``tok``. Raises ``ValueError`` where HF could not agree: a single
    byte missing from the ranks (HF would drop it), or a special name HF's decoder would not give back as its UTF-8."""
    n = tok.num_bpe_ranks
    ranks = {tok.id_to_bytes(i): i for i in range(n)}
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"byte {missing[0]:#04x} is not a BPE token; HF's BPE would drop it where tiktoken fails")
    added = []
    for token_id in range(n, tok.vocab_size):
        name = tok.id_to_token(token_id)
        if byte_level_decode(name) != name.encode("utf-8"):
            raise ValueError(f"special {name!r} would decode differently in HF: its chars are all in the byte "
                             f"alphabet, so HF's ByteLevel decoder maps them to single bytes")
        added.append({"id": token_id, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": KIMI_PAT_STR}, "behavior": "Isolated", "invert": False},
            _BYTE_LEVEL,
        ]},
        "post_processor": None,
        "decoder": _BYTE_LEVEL,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {byte_level_string(t): i for t, i in ranks.items()}, "merges": _merges(ranks)},
    }


def write_tokenizer_json(folder: str | Path) -> Path:
    """Write ``folder/tokenizer.json`` from the folder's ``tiktoken.model`` + ``tokenizer_config.json``; return its
    path. Deterministic: the same files give a byte-identical ``tokenizer.json``."""
    folder = Path(folder)
    tok = load_tokenizer(folder)
    if not isinstance(tok, TiktokenTokenizer):
        raise ValueError(f"{folder} has no tiktoken.model to convert")
    path = folder / TOKENIZER_JSON_FILE
    path.write_text(json.dumps(tokenizer_json(tok), ensure_ascii=False, indent=1) + "\n", encoding="utf-8",
                    newline="\n")
    return path
