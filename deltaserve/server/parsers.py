"""Model output -> `reasoning_content`, `content`, `tool_calls` (docs/chat.md §3.4–3.6 for K3, §4 for K2/Kimi-Linear).

Both parsers work on **token ids** (docs/chat.md §3.6): structural markers are special ids that user, tool and model
text can never produce, so parsing is a state machine keyed on those ids that decodes only the text between them.
The result does not depend on `skip_special_tokens` or on spacing between special tokens, and a string argument
that literally contains `<|close|>argument<|sep|>` is parsed correctly.

One state machine serves both interfaces: `XOutputParser.parse(ids)` runs a fresh `XStreamParser` over all ids and
assembles its deltas, so the streamed deltas of any chunking reassemble exactly the non-streamed parse.

Streaming rules:
* reasoning and content are emitted as soon as their bytes form complete UTF-8 characters (an incomplete character
  is held back until its marker or `finish()`, then becomes U+FFFD, like `Tokenizer.decode`);
* a tool call is emitted only once its closing marker has arrived, as one delta carrying `index`, `id`, `name` and the
  whole `arguments` JSON (docs/chat.md §3.5, vLLM behaviour); a call cut off by `max_tokens` is never emitted. With
  `stream_arguments=True` the first delta of a call (`index`, `id`, `name`, `arguments=""`) is sent when the call
  opens and argument fragments follow as they are generated (string values character by character); a call that
  is cut off or malformed is then left unfinished in the stream while `parse` drops it — the only case where the
  two differ.
"""
from __future__ import annotations

from collections.abc import Callable

from ..config import ModelConfig
from ..tokenizer import Tokenizer
from .output_base import Delta, ParsedOutput, ToolCall, ToolCallDelta, assemble, default_call_id
from .output_k2 import K2OutputParser, K2StreamParser, PlainOutputParser, PlainStreamParser
from .output_k3 import K3OutputParser, K3StreamParser

__all__ = [
    "ToolCall", "ParsedOutput", "ToolCallDelta", "Delta", "assemble", "default_call_id",
    "K3OutputParser", "K3StreamParser", "K2OutputParser", "K2StreamParser", "PlainOutputParser",
    "PlainStreamParser", "parser_for",
]  # fmt: skip


def parser_for(config: ModelConfig, tokenizer: Tokenizer,
               make_id: Callable[[str, int], str] | None = None) -> K3OutputParser | K2OutputParser | PlainOutputParser:
    """The output parser of a model family: K3 XTML, K2 section markers (Kimi-Linear), or plain content."""
    if config.family == "kimi_k3":
        return K3OutputParser(tokenizer, make_id)
    if config.family == "kimi_linear":
        return K2OutputParser(tokenizer, make_id)
    return PlainOutputParser(tokenizer, make_id)
