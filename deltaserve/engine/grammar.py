"""Structured outputs: token masks from llguidance grammars (docs/serving.md §10 "Structured outputs").

`Grammars` (one per engine) wraps llguidance over the model's tokenizer. It turns a `StructuredOutputsParams` into
llguidance's grammar text, validates and compiles it once per distinct text (a bounded cache: a server sees the same
few schemas over and over), and gives each completion a copy of the compiled matcher at its start. Each step, `allowed` computes the masks of every
constrained row in one parallel call and returns them as a bool tensor [rows, vocab]; the sampler sets the logits
of the other tokens to -inf before anything else (engine/sampler.py), and the core advances each matcher with the
token it appended (engine/core.py). A grammar that has reached its end allows only the stop ids.

llguidance's own grammar syntax: https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md. JSON schemas
compile to compact JSON with one space after `:` and `,` (the way `json.dumps` writes it): flexible whitespace would
let a model pad an object with newlines forever.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable

import llguidance
import numpy as np
import torch

from ..tokenizer import Tokenizer
from .sampling_params import InvalidRequestError, StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # distinct grammar texts whose validation and compiled matcher are remembered


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar text for `spec` (not yet checked against a tokenizer)."""
    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        return llguidance.LLMatcher.grammar_from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                                            defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    text = spec.grammar
    if text.lstrip().startswith("{"):  # an llguidance JSON grammar, e.g. one the server composed for a chat format
        return text
    return llguidance.LLMatcher.grammar_from_lark(text)


def named_grammars(spec: StructuredOutputsParams, name: str) -> list[dict]:
    """The grammars of `spec` as entries of a top-level llguidance grammar, the first named `name` so that a Lark
    rule of another grammar can refer to it as `@name` (server/constraints.py wraps a chat format around it)."""
    grammars = json.loads(grammar_text(spec))["grammars"]
    return [{**grammars[0], "name": name}, *grammars[1:]]


class Grammars:
    """llguidance over one tokenizer and vocabulary; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Iterable[int], num_threads: int | None = None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_ids = sorted(stop_ids)
        self.num_threads = num_threads
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._checked: OrderedDict[str, str] = OrderedDict()  # grammar text -> "" (valid) or the error
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar text -> matcher at start

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use: the bytes of every token id (specials by name), the model's stop ids as EOS."""
        if self._lltokenizer is None:
            table = _TokenTable(self.tokenizer, self.vocab_size)
            self._lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(table), eos_token=self.stop_ids)
        return self._lltokenizer

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The checked grammar text of `spec`; raises InvalidRequestError("structured_outputs", why) when llguidance
        cannot compile it for this tokenizer."""
        try:
            text = grammar_text(spec)
        except (ValueError, RuntimeError) as exc:
            raise InvalidRequestError("structured_outputs", f"structured_outputs cannot be compiled: {exc}") from None
        error = self._checked.get(text)
        if error is None:
            error = llguidance.LLMatcher.validate_grammar(text, self.lltokenizer)
            self._checked[text] = error
            if len(self._checked) > CACHE_SIZE:
                self._checked.popitem(last=False)
        else:
            self._checked.move_to_end(text)
        if error:
            raise InvalidRequestError("structured_outputs", f"structured_outputs cannot be compiled: {error}")
        return text

    def matcher(self, text: str) -> llguidance.LLMatcher:
        """A matcher at the start of the output, for a text `compile` returned: a copy of the one compiled for it."""
        start = self._compiled.get(text)
        if start is None:
            start = self._compiled[text] = llguidance.LLMatcher(self.lltokenizer, text, log_level=0)
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(text)
        return start.deep_copy()

    def allowed(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """Bool [len(matchers), vocab_size]: the tokens each matcher allows next, computed in parallel."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self.num_threads)
        words = (self.vocab_size + 31) // 32
        bits = np.zeros((len(matchers), words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.ctypes.data,
                                               words * 4, len(matchers))
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        return torch.from_numpy(unpacked.astype(bool))


class _TokenTable:
    """What llguidance.TokenizerWrapper reads of a tokenizer: every id's bytes, the special ids, and encoding (for
    the text a grammar forces). Ids of the model's vocabulary beyond the tokenizer's (a padded output layer) are
    unnamed specials, which no grammar allows."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        known = min(tokenizer.vocab_size, vocab_size)
        self.tokens = [tokenizer.id_to_bytes(i) for i in range(known)]
        self.tokens += [f"<|padding_{i}|>".encode() for i in range(known, vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if i >= known or tokenizer.is_special(i)]
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)
