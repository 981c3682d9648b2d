"""GET /tokenizer_info (docs/serving.md §10): the tokenizer's configuration, shaped as vLLM serves it.

vLLM answers with the tokenizer's ``tokenizer_config.json`` fields (AddedToken objects flattened to their
``content``, file paths left out), plus ``tokenizer_class`` and ``chat_template``. Clients that tokenise through the
server (lm-evaluation-harness' remote tokenizer) read ``eos_token``, ``bos_token``, ``pad_token`` and
``chat_template`` from it, so those keys are always present (null when the tokenizer has none).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from ..tokenizer import Tokenizer

_FILE_FIELDS = ("vocab_file", "merges_file", "tokenizer_file")


class TokenizerInfoResponse(BaseModel):
    """The fields every answer has; the rest of ``tokenizer_config.json`` rides along as extra fields."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    model_max_length: int | None
    chat_template: str | None


def _flatten(value: Any) -> Any:
    """AddedToken objects (``{"content": ...}``) -> their content, inside objects and lists too."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return value["content"]
        return {k: _flatten(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_flatten(v) for v in value]
    return value


def tokenizer_info(tok: Tokenizer) -> TokenizerInfoResponse:
    """``tok``'s configuration as /tokenizer_info answers it. ``tokenizer_class`` is the config's (the class HF
    tools load the folder with), else the deltaserve class that read it; ``chat_template`` is the one deltaserve
    renders with, which may come from ``chat_template.jinja``."""
    info = {k: _flatten(v) for k, v in tok.tokenizer_config.items() if k not in _FILE_FIELDS}
    declared = info.get("tokenizer_class")
    info["tokenizer_class"] = declared if isinstance(declared, str) else type(tok).__name__
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = info.get(key)
        info[key] = value if isinstance(value, str) else None
    info["model_max_length"] = tok.model_max_length if isinstance(tok.model_max_length, int) else None
    info["chat_template"] = tok.chat_template
    return TokenizerInfoResponse.model_validate(info)
