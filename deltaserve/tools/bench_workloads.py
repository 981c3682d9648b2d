"""Seeded text workloads for `deltaserve bench serve` (any OpenAI-compatible endpoint, so prompts are text).

A workload is a list of conversations; a conversation is an optional system prompt and one or more user turns,
sent one after another, each turn carrying the replies received so far. Lengths are in words drawn from a fixed
word list (a word is one to a few tokens, depending on the tokenizer; the server's `usage` gives the exact counts).
The same (kind, sizes, seed) always yields the same text.

- fixed: one turn of `input_len` words per conversation.
- shared-prefix: one system prompt of `prefix_len` words shared by all, then one turn of `input_len` words.
- multi-turn: `turns` turns of `input_len` words each.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOADS = ("fixed", "shared-prefix", "multi-turn")

_WORDS = ("time year people way day man thing woman life child world school state family student group country "
          "problem hand part place case week company system program question work government number night point "
          "home water room mother area money story fact month lot right study book eye job word business issue "
          "side kind head house service friend father power hour game line end member law car city community name "
          "president team minute idea kid body information back parent face others level office door health person "
          "art war history party result change morning reason research girl guy moment air teacher force education "
          "alpha beta gamma delta kernel tensor cache page token model state layer expert router decode prefill "
          "stream batch queue engine server client latency bandwidth matrix vector scalar memory thread core").split()


@dataclass(frozen=True)
class Conversation:
    system: str | None
    turns: tuple[str, ...]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def make_workload(kind: str, num_requests: int, input_len: int, seed: int, prefix_len: int = 1000,
                  turns: int = 3) -> list[Conversation]:
    """Conversations totalling `num_requests` requests (multi-turn: num_requests // turns conversations, at least 1)."""
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}; choose from {', '.join(WORKLOADS)}")
    rng = random.Random(seed)
    if kind == "fixed":
        return [Conversation(None, (_text(rng, input_len),)) for _ in range(num_requests)]
    if kind == "shared-prefix":
        system = _text(rng, prefix_len)
        return [Conversation(system, (_text(rng, input_len),)) for _ in range(num_requests)]
    return [Conversation(None, tuple(_text(rng, input_len) for _ in range(turns)))
            for _ in range(max(1, num_requests // turns))]


def chat_messages(conv: Conversation, turn: int, replies: list[str]) -> list[dict]:
    """The messages of request `turn` of `conv`: system, then the earlier turns with their replies, then the turn."""
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    for user, reply in zip(conv.turns[:turn], replies):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return messages + [{"role": "user", "content": conv.turns[turn]}]


def completion_prompt(conv: Conversation, turn: int, replies: list[str]) -> str:
    """The same request as plain text for /v1/completions: the message contents joined by newlines."""
    return "\n".join(m["content"] for m in chat_messages(conv, turn, replies))
