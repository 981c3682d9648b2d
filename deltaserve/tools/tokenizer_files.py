"""Write real-layout Kimi tokenizer files (``tiktoken.model`` + ``tokenizer_config.json``) for small test models,
with the equivalent Hugging Face ``tokenizer.json`` beside them (``tokenizer_json.py``).

Layout matches the checkpoints (docs/chat.md §1.1–1.3): ranks 0..255 are the single bytes in byte order, then merges
learned by a deterministic byte-level BPE trainer, then 256 special ids at the real offsets (real id - 163584).

Pre-tokenisation: tiktoken does not expose its splitter, so training splits with the ``regex`` module (a tiktoken
dependency) in V1 mode, where ``&&`` is class intersection with the same precedence as fancy-regex. This only
steers which merges get learned; the written file is valid whatever the split. tests/test_tokenizer.py checks the
split against tiktoken itself.

Every learned token is *reachable*: tiktoken's BPE applied to its bytes with the lower ranks yields exactly two
parts, so tiktoken produces it (a merge whose result would not be produced is skipped, never written).
"""

from __future__ import annotations

import base64
import heapq
import json
import random
from collections import Counter
from pathlib import Path

import regex

from deltaserve.tokenizer import KIMI_PAT_STR
from deltaserve.tools.tokenizer_json import write_tokenizer_json

FAMILIES = ("kimi_k3", "kimi_linear", "deepseek")

_K3_SPECIALS: dict[str, int] = {
    "[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5,
    "[start_header_id]": 6, "[end_header_id]": 7, "[EOT]": 9, "<|media_begin|>": 18, "<|media_content|>": 19,
    "<|media_end|>": 20, "<|media_pad|>": 21, "<osagent_mode>": 65, "[UNK]": 254, "[PAD]": 255,
}  # fmt: skip
_K2_SPECIALS: dict[str, int] = {
    "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4, "<|start_header_id|>": 6,
    "<|end_header_id|>": 7, "[EOT]": 9, "<|im_system|>": 10, "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12, "<|tool_call_begin|>": 13, "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15, "<|im_middle|>": 17, "<|media_begin|>": 18, "<|media_content|>": 19,
    "<|media_end|>": 20, "<|media_pad|>": 21, "<think>": 22, "</think>": 23, "[UNK]": 254, "[PAD]": 255,
}  # fmt: skip

# K2-Instruct-style template (docs/chat.md §4), written for test models. Tool results use the K2-Thinking
# "## Return of" form; the image opener is spelled <|media_begin|> because that is the name in this table.
K2_CHAT_TEMPLATE = """\
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and message.role != 'system' -%}
<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>
{%- endif -%}
{%- set role_name = message.name if message.name else message.role -%}
{%- if message.role == 'user' -%}
<|im_user|>{{ role_name }}<|im_middle|>
{%- elif message.role == 'assistant' -%}
<|im_assistant|>{{ role_name }}<|im_middle|>
{%- elif message.role == 'tool' -%}
<|im_system|>tool<|im_middle|>## Return of {{ message.tool_call_id }}{{ '\\n' }}
{%- else -%}
<|im_system|>{{ role_name }}<|im_middle|>
{%- endif -%}
{%- if message.content is string -%}
{{ message.content }}
{%- elif message.content is iterable -%}
{%- for part in message.content -%}
{%- if part.type == 'text' -%}
{{ part.text }}
{%- elif part.type in ['image', 'image_url'] -%}
<|media_begin|>image<|media_content|><|media_pad|><|media_end|>
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
<|tool_calls_section_begin|>
{%- for call in message.tool_calls -%}
<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>
{%- if call.function.arguments is string -%}
{{ call.function.arguments }}
{%- else -%}
{{ call.function.arguments | tojson }}
{%- endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}"""

SAMPLE_CORPUS = """\
The quick brown fox jumps over the lazy dog. It's a sentence that contains every letter of the alphabet, and
it's been used for typing practice since the late nineteenth century. We'll use it here, together with some
code, some JSON and some Chinese, to learn a tiny byte-level vocabulary for test models.
Language models read text as tokens. A tokenizer splits the input into pieces with a regular expression, then
merges frequent byte pairs inside each piece. The merges are ranked: lower ranks were learned first and are
applied first. Numbers are split into groups of at most three digits, like 123 456 7890 and 3.14159.
The weather in Paris today is sunny, with a high of 18 degrees. Tomorrow there's a chance of rain in London
and Berlin. Please call the function get_weather with the city and the number of days you need.
You are a helpful assistant. The user asked a question; the assistant should think, then respond clearly.
<|open|>message role="user"<|sep|>What is the capital of France?<|close|>message<|sep|>
<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Need tool.<|close|>think<|sep|>
<|open|>response<|sep|>The capital of France is Paris.<|close|>response<|sep|><|close|>message<|sep|>
<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city"
type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


if __name__ == "__main__":
    print(fibonacci(10))
    for i in range(3):
        print(f"value = {i * 2}")

function add(a, b) {
    return a + b;
}
const items = [1, 2, 3].map((x) => x * x);
console.log(JSON.stringify({ items, total: items.reduce(add, 0) }));

{"name": "get_weather", "description": "Get the weather for a city", "parameters": {"type": "object",
 "properties": {"city": {"type": "string"}, "days": {"type": "number"}}, "required": ["city"]}}
{"role": "tool", "content": "{\\"temp\\": 18, \\"unit\\": \\"celsius\\"}", "tool_call_id": "functions.get_weather:0"}

SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 10;
$ git commit -m "Fix the tokenizer" && git push origin main

今天天气很好，我们去公园散步吧。北京市是中国的首都，也是一座历史悠久的城市。
人工智能正在改变世界，语言模型可以回答问题、写代码、翻译文章。
请调用天气函数查询上海明天的天气情况。这个模型的中文能力很强，English混合也没有问题。
中文English混合的句子需要正确切分：中文、English、混合。
我们需要一个小的词表来测试推理引擎，它应该包含常见的汉字和英文单词。

Ünïcödé text: café, naïve, Straße, Ελληνικά, русский язык, 日本語のテキスト, 한국어 문장.
Emoji: 😀 🎉 👍🏽 🚀 ❤️ — and symbols like ©, ®, ™, €, £, ¥, ±, ×, ÷, →, ←, ≤, ≥.
Whitespace:    four spaces,	a tab, and trailing spaces   
"""


def special_token_offsets(family: str) -> dict[str, int]:
    """Named specials of a family as offsets from ``num_bpe_ranks`` (real id - 163584)."""
    if family == "kimi_k3":
        return dict(_K3_SPECIALS)
    if family in ("kimi_linear", "deepseek"):  # deepseek test models reuse the K2 table (no real table here)
        return dict(_K2_SPECIALS)
    raise ValueError(f"unknown tokenizer family {family!r}; expected one of {FAMILIES}")


def _bpe_parts(piece: bytes, ranks: dict[bytes, int]) -> int:
    """Number of tokens tiktoken's merge loop leaves for ``piece`` (lowest rank first, leftmost on ties)."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_i = rank, i
        if best_rank is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return len(parts)


def _learn_merges(text: str, ranks: dict[bytes, int], vocab: list[bytes], target: int) -> None:
    """Greedy BPE over the pre-tokenised ``text``: most frequent pair first, ties by the pair's bytes."""
    freqs = Counter(p.encode("utf-8") for p in regex.findall(r"(?V1)" + KIMI_PAT_STR, text))
    words: list[list[int]] = [list(w) for w in freqs]  # token ids (== ranks) per distinct piece
    counts: list[int] = list(freqs.values())
    pair_count: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}

    def account(w: int, sign: int) -> list[tuple[int, int]]:
        word = words[w]
        pairs = list(zip(word, word[1:]))
        for pair in pairs:
            pair_count[pair] += sign * counts[w]
            if sign > 0:
                where.setdefault(pair, set()).add(w)
        return pairs

    for w in range(len(words)):
        account(w, +1)
    heap = [(-c, vocab[a], vocab[b], a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    banned: set[tuple[int, int]] = set()
    while heap and len(vocab) < target:
        neg, _, _, a, b = heapq.heappop(heap)
        if (a, b) in banned or pair_count[(a, b)] != -neg:
            continue  # stale heap entry (lazy invalidation)
        merged = vocab[a] + vocab[b]
        if merged in ranks or _bpe_parts(merged, ranks) != 2:
            banned.add((a, b))  # tiktoken would never produce it: leave this pair unmerged for good
            continue
        new_id = len(vocab)
        ranks[merged] = new_id
        vocab.append(merged)
        changed: set[tuple[int, int]] = set()
        for w in sorted(where.pop((a, b), ())):
            changed.update(account(w, -1))
            old, new = words[w], []
            i = 0
            while i < len(old):  # replace non-overlapping (a, b) left to right
                if i + 1 < len(old) and old[i] == a and old[i + 1] == b:
                    new.append(new_id)
                    i += 2
                else:
                    new.append(old[i])
                    i += 1
            words[w] = new
            changed.update(account(w, +1))
        for pair in changed:
            c = pair_count.get(pair, 0)
            if c > 0:
                heapq.heappush(heap, (-c, vocab[pair[0]], vocab[pair[1]], pair[0], pair[1]))


def _pad_ranks(ranks: dict[bytes, int], vocab: list[bytes], target: int, seed: int) -> None:
    """Fill up to ``target`` with reachable concatenations of two random existing tokens (deterministic in seed)."""
    rng = random.Random(seed)
    while len(vocab) < target:
        candidate = vocab[rng.randrange(len(vocab))] + vocab[rng.randrange(len(vocab))]
        if len(candidate) <= 16 and candidate not in ranks and _bpe_parts(candidate, ranks) == 2:
            ranks[candidate] = len(vocab)
            vocab.append(candidate)


def build_ranks(num_bpe_ranks: int, seed: int = 0, corpus: str | None = None) -> dict[bytes, int]:
    """Bytes 0..255, then learned merges, then seeded padding; exactly ``num_bpe_ranks`` reachable tokens."""
    if num_bpe_ranks < 256:
        raise ValueError(f"num_bpe_ranks must be >= 256 (the single bytes), got {num_bpe_ranks}")
    vocab = [bytes([b]) for b in range(256)]
    ranks = {tok: i for i, tok in enumerate(vocab)}
    _learn_merges(SAMPLE_CORPUS if corpus is None else corpus, ranks, vocab, num_bpe_ranks)
    _pad_ranks(ranks, vocab, num_bpe_ranks, seed)
    return ranks


def tokenizer_config(family: str, num_bpe_ranks: int, model_max_length: int = 131072) -> dict[str, object]:
    """The ``tokenizer_config.json`` object for ``family`` (HF layout, ``added_tokens_decoder`` keyed by str(id))."""
    offsets = special_token_offsets(family)
    decoder = {
        str(num_bpe_ranks + off): {
            "content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
        for name, off in sorted(offsets.items(), key=lambda kv: kv[1])
    }  # fmt: skip
    config: dict[str, object] = {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [
            name for name in sorted(offsets, key=offsets.__getitem__) if name not in ("[BOS]", "[UNK]", "[PAD]")
        ],
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|end_of_msg|>" if family == "kimi_k3" else "<|im_end|>",
        "model_max_length": model_max_length,
        "pad_token": "[PAD]",
        # The fast class reads tokenizer.json; the name is the one transformers 4 and 5 both resolve.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "[UNK]",
    }
    if family != "kimi_k3":  # K3's renderer is code, not Jinja (docs/chat.md §2)
        config["chat_template"] = K2_CHAT_TEMPLATE
    return config


def write_tokenizer_files(
    out_dir: str | Path, family: str, num_bpe_ranks: int, seed: int = 0, corpus: str | None = None
) -> int:
    """Write ``tiktoken.model``, ``tokenizer_config.json`` and ``tokenizer.json`` into ``out_dir``; return the number
    of BPE ranks.

    Deterministic: the same arguments give byte-identical files. ``seed`` only affects padding ranks, used when
    the corpus yields fewer merges than requested. Special ids are ``num_bpe_ranks + offset``; the rest of the
    256-id range is left unnamed (``<|reserved_token_{id}|>`` at load time).
    """
    config = tokenizer_config(family, num_bpe_ranks)  # validates family before the (slower) training
    ranks = build_ranks(num_bpe_ranks, seed, corpus)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for tok, rank in ranks.items()]
    (out / "tiktoken.model").write_text("".join(lines), encoding="ascii", newline="\n")
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8", newline="\n"
    )
    write_tokenizer_json(out)
    return len(ranks)
