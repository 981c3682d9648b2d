"""Test strings for comparing tokenizers (tests/test_tokenizer_json.py): code, Unicode, whitespace and special
spellings, each well below the 25,000-char run at which Kimi's encoder cuts (docs/chat.md §1.5), where HF does not."""

from __future__ import annotations

import random

_HANDWRITTEN = [
    # Python
    "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    return [a := a + b for _ in range(n)]\n",
    "class Stack:\n    def __init__(self):\n        self._items = []\n\n    def push(self, x):\n"
    "        self._items.append(x)\n",
    "import os\nimport sys\n\n\nif __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n",
    '    """Docstring with ``rst`` and a doctest.\n\n    >>> f(2)\n    4\n    """\n',
    "x = {'a': [1, 2, 3], \"b\": (4, 5), 'c': {6}}\nprint(f\"{x!r:>40}\")\n",
    "async def main():\n\tawait asyncio.gather(*(fetch(u) for u in urls))\n",
    "lambda x, *args, **kw: x**2 // 3 % 7 if x else -x ^ ~0 << 2 >> 1",
    "@dataclass(frozen=True)\nclass P:\n    x: float = 0.0\n    y: float = -1e-9\n",
    "try:\n    pass\nexcept (ValueError, KeyError) as exc:\n    raise RuntimeError('boom') from exc\n",
    # C
    "#include <stdio.h>\n\nint main(int argc, char **argv) {\n    printf(\"%d\\n\", argc);\n    return 0;\n}\n",
    "static inline uint32_t rotl(uint32_t x, int k) { return (x << k) | (x >> (32 - k)); }",
    "for (size_t i = 0; i < n; ++i) {\n\tif (a[i] != b[i]) goto fail;\n}\n/* done */\n",
    "#define MAX(a, b) ((a) > (b) ? (a) : (b))\nstruct node { struct node *next; void *data; };",
    # JSON
    '{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}',
    '[{"id":1,"ok":true,"v":null},{"id":2,"ok":false,"v":-3.25e+10}]',
    '{\n  "nested": {\n    "deep": [\n      [],\n      {}\n    ]\n  },\n  "esc": "\\u00e9\\n\\t\\"q\\""\n}',
    # shell
    "$ git commit -m \"Fix the tokenizer\" && git push origin main 2>&1 | tee log.txt",
    "for f in *.py; do echo \"$f\"; wc -l \"$f\"; done > counts.txt\nexport PATH=$HOME/bin:$PATH",
    "curl -s -H 'Authorization: Bearer $KEY' https://example.com/v1/models | jq '.data[].id'",
    "#!/usr/bin/env bash\nset -euo pipefail\n[[ -z \"${VAR:-}\" ]] || exit 1\n",
    # CJK / Han with Latin
    "中文English混合的句子需要正确切分：中文、English、混合。",
    "北京市 Pascal 上海市Shanghai广州",
    "日本語のテキストとカタカナ、ひらがな、漢字が混ざっている。",
    "한국어 문장과 English words 섞어서",
    "人工智能正在改变世界，语言模型可以回答问题、写代码、翻译文章。",
    "Unicode名前: 田中太郎 (Tanaka Tarō) さん",
    "中A文B字C",
    "龍𠀀𪚥𰀀 rare Han from extension planes",
    # emoji
    "Emoji: 😀 🎉 👍🏽 🚀 ❤️ and 👨‍👩‍👧‍👦 (a ZWJ family)",
    "🏳️‍🌈🏴‍☠️👩🏿‍💻🧑‍🤝‍🧑",
    "flags 🇫🇷🇩🇪🇯🇵 keycaps 1️⃣#️⃣ skin 👋🏻👋🏼👋🏽👋🏾👋🏿",
    # combining marks
    "e\u0301 a\u0308 n\u0303 o\u0302\u0323 Z\u0335\u0321a\u0336l\u0337g\u0338o\u0334",
    "Ünïcödé café naïve Straße façade coöperate",
    "क्षत्रिय हिन्दी देवनागरी",
    "ก้าวไปข้างหน้า ภาษาไทย",
    # RTL
    "العربية: مرحبا بالعالم، كيف حالك؟",
    "עברית: שלום עולם! mixed עם English",
    "\u202eRTL override\u202c and \u200fmarks\u200e",
    # full-width and other digits
    "全角数字１２３４５６７８９０と半角1234567890",
    "Ⅻ ½ ² ³ ٣٤٥ ๑๒๓ 𝟙𝟚𝟛",
    "ＡＢＣ　ｄｅｆ！？＠＃",
    # whitespace runs
    "   leading, trailing   ",
    "a" + " " * 40 + "b",
    "\t\t\tindented\twith\ttabs\t\t",
    "mixed \u3000 ideographic\u00a0nbsp\u2009thin\u200bzero-width",
    " " * 17,
    "\u2028line sep\u2029para sep\u0085nel",
    # newlines and CRLF
    "line one\nline two\n\n\nline five\n",
    "windows\r\nline\r\nendings\r\n\r\n",
    "\r\r\n\n\r mixed \n\r\n",
    "trailing spaces   \n   \n\t\n",
    "}\n\n\n\n    return x\n",
    # long digit runs
    "1234567890123456789012345678901234567890",
    "pi = 3.14159265358979323846264338327950288419716939937510",
    "0x7fffffffffffffff 0b1010101010101010 1e308 -0.000001",
    "IPv4 192.168.100.254:8080, date 2024-12-31T23:59:59Z",
    "9" * 200,
    # contractions
    "It's what they'd've wanted; we're sure you'll see it's fine.",
    "DON'T SHOUT, I'LL HEAR YOU. She'S he'LL They'RE I'M We'VE",
    "rock 'n' roll 'quoted' words' ends 's 'll",
    "l'été d'avant, aujourd'hui c'est l'heure",
    # special spellings (K3 and K2 tables, reserved and bracketed names)
    "<|open|>message role=\"user\"<|sep|>What is the capital?<|close|>message<|sep|><|end_of_msg|>",
    "<|im_system|>system<|im_middle|>You are helpful<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>",
    "[BOS]text[EOS] [PAD][UNK] [EOT]",
    "<think>reasoning</think> answer <|tool_calls_section_begin|><|tool_call_begin|>f<|tool_call_end|>",
    "broken <|open| and |> and <|op en|> and <|OPEN|>",
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>",
    "literal <osagent_mode> [start_header_id]x[end_header_id]",
    # mixed / misc
    "The quick brown fox jumps over the lazy dog. 1234567!",
    "URLs: https://example.com/a/b?c=d&e=f#g — emails: a.b+c@d.co",
    "math: ∀x∈ℝ, ∃y: x² + y² ≤ 1 ⇒ |x| ≤ 1; ∑ᵢ aᵢ = ∫₀¹ f(t) dt",
    "symbols ©®™€£¥±×÷→←≤≥",
    "Ελληνικά русский язык ქართული Հայերեն",
    "control \x00\x01\x07\x1b[31mred\x1b[0m\x7f",
    "",
]

_FRAGMENTS = [
    "def", " f(x):", "\n    ", "return", " x", "中文", "English", "😀", "👨‍👩‍👧", "e\u0301", "שלום", "１２３",
    "  ", "\r\n", "\n\n", "\t", "123456", "'s", "'LL", "<|open|>", "<|im_end|>", "[BOS]", "{\"a\": 1}", "$PATH",
    "北京", "Straße", "—", "...", "🇫🇷", "\u3000", "ﬁ", "İ", "ß", "ǅ", "Ⅸ",
]


def _mixed(count: int, seed: int) -> list[str]:
    """Seeded concatenations of the fragments above, so boundaries between categories are exercised too."""
    rng = random.Random(seed)
    return ["".join(rng.choice(_FRAGMENTS) for _ in range(rng.randrange(3, 24))) for _ in range(count)]


STRINGS: list[str] = _HANDWRITTEN + _mixed(100 - len(_HANDWRITTEN), seed=0)
