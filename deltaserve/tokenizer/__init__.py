"""Tokenizers (docs/chat.md §1): one interface (``base.Tokenizer``) over Kimi's ``tiktoken.model``
(``tiktoken_kimi``) or a Hugging Face ``tokenizer.json`` (``hf_tokenizer``); ``load_tokenizer`` picks by the files."""

from __future__ import annotations

from pathlib import Path

from .base import CONFIG_FILE, IncrementalDecoder, Tokenizer, TokenizerError, read_tokenizer_config
from .hf_tokenizer import TOKENIZER_JSON_FILE, HFTokenizer, read_tokenizer_json
from .tiktoken_kimi import (KIMI_PAT_STR, MAX_ENCODE_CHARS, MAX_RUN_CHARS, NUM_SPECIAL_TOKENS, TIKTOKEN_FILE,
                            TiktokenTokenizer, read_tiktoken_model, reserved_token_name, split_for_encoding)

__all__ = [
    "CONFIG_FILE", "HFTokenizer", "IncrementalDecoder", "KIMI_PAT_STR", "MAX_ENCODE_CHARS", "MAX_RUN_CHARS",
    "NUM_SPECIAL_TOKENS", "TIKTOKEN_FILE", "TOKENIZER_JSON_FILE", "TiktokenTokenizer", "Tokenizer", "TokenizerError",
    "load_tokenizer", "read_tiktoken_model", "reserved_token_name", "split_for_encoding",
]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint folder: ``tiktoken.model`` + ``tokenizer_config.json`` when the folder has
    ``tiktoken.model``, else ``tokenizer.json`` (+ ``tokenizer_config.json`` when present); ``chat_template.jinja``
    stands in for a config without ``chat_template``. Neither vocabulary file: a ``TokenizerError`` naming both."""
    folder = Path(path)
    if (folder / TIKTOKEN_FILE).exists():
        ranks = read_tiktoken_model(folder / TIKTOKEN_FILE)
        config = read_tokenizer_config(folder, required=True)
        return TiktokenTokenizer(ranks, config, source=str(folder / CONFIG_FILE))
    if (folder / TOKENIZER_JSON_FILE).exists():
        text = read_tokenizer_json(folder / TOKENIZER_JSON_FILE)
        return HFTokenizer(text, read_tokenizer_config(folder, required=False),
                           source=str(folder / TOKENIZER_JSON_FILE))
    raise TokenizerError(f"tokenizer file not found: {folder} has neither {TIKTOKEN_FILE} nor {TOKENIZER_JSON_FILE}")
