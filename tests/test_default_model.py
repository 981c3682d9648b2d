"""The shipped default model (deltaserve/data/default_model): files, tokenizer, perplexities on the two held-out texts
against the figures in README.md ("Default model" section), the function-header completions the README shows."""

import base64
import math
import re
from pathlib import Path

import pytest
import torch

import deltaserve
from deltaserve.config import ModelConfig
from deltaserve.default_model import default_model_path
from deltaserve.models.loader import load_config
from deltaserve.tools import corpus
from deltaserve.tools.make_model import build_random
from deltaserve.tools.presets import get_preset
from deltaserve.tools.tokenizer_files import _bpe_parts
from deltaserve.tools.train import (FUNCTION_HEADERS, HEADER_COMPLETION_TOKENS, check_header_completion, evaluate,
                                   greedy_completion, header_prompt)

README = Path(__file__).resolve().parent.parent / "README.md"
EVAL_SEQ_LEN, EVAL_TOKENS = 256, 8192  # the fixed slice: the first 32 windows of 256(+1) validation tokens


def _readme_figure(name: str) -> str:
    m = re.search(rf"<!-- {name} -->\s*`?([^`\n<]+)`?", README.read_text(encoding="utf-8"))
    assert m, f"README.md has no '<!-- {name} -->' figure"
    return m.group(1).strip()


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def val_ids(model_dir):
    return deltaserve.load_tokenizer(model_dir).encode(corpus.validation_text())


def test_shipped_files(model_dir):
    assert model_dir.is_relative_to(Path(deltaserve.__file__).resolve().parent)
    for name in ("config.json", "model.safetensors", "tiktoken.model", "tokenizer_config.json", "tokenizer.json"):
        assert (model_dir / name).is_file(), name
    size = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert size < 50 * 2**20, size
    drafter = model_dir / "dspark"  # the DSpark drafter shipped beside it: the whole package stays under 60 MB
    assert (drafter / "config.json").is_file() and (drafter / "model.safetensors").is_file()
    assert size + sum(p.stat().st_size for p in drafter.iterdir()) < 60 * 2**20
    assert corpus.VALIDATION_PATH.stat().st_size <= 310_000
    # the shipped shape is the k31-stdlib preset, K3.1 (DSA) with every K3 part active
    config = load_config(model_dir)
    assert config.is_k31 and config.family == "kimi_k3"
    assert ModelConfig.from_dict(get_preset("k31-stdlib").config).num_layers == config.num_layers


def test_tokenizer_round_trips(model_dir):
    tok = deltaserve.load_tokenizer(model_dir)
    ranks = {}
    for line in (model_dir / "tiktoken.model").read_text(encoding="ascii").splitlines():
        b64, rank = line.split()
        ranks[base64.b64decode(b64)] = int(rank)
    assert sorted(ranks.values()) == list(range(len(ranks))) == list(range(get_preset("k31-stdlib").num_bpe_ranks))
    for token, rank in ranks.items():
        assert tok.decode_bytes([rank]) == token
        assert len(token) == 1 or _bpe_parts(token, ranks) == 1  # tiktoken's BPE reaches it from its bytes
    n = len(ranks)
    assert tok.encode("[BOS]", allow_special=True) == [n]
    assert tok.encode("<|end_of_msg|>", allow_special=True) == [n + 2]
    text = 'def fibonacci(n):\n    """Return the n-th number."""\n    return n  # café 北京 😀\n'
    assert tok.decode(tok.encode(text)) == text


def test_validation_perplexity(model_dir, val_ids):
    torch.manual_seed(0)
    trained = deltaserve.load_model(model_dir, dtype="float32")
    loss = evaluate(trained, val_ids, seq_len=EVAL_SEQ_LEN, max_tokens=EVAL_TOKENS)
    fresh = build_random(load_config(model_dir), seed=0)
    fresh_loss = evaluate(fresh, val_ids, seq_len=EVAL_SEQ_LEN, max_tokens=EVAL_TOKENS)
    ppl, fresh_ppl = math.exp(loss), math.exp(fresh_loss)
    print(f"validation perplexity: trained {ppl:.3f}, fresh {fresh_ppl:.1f}")
    readme_ppl = float(_readme_figure("val-ppl"))
    assert abs(ppl - readme_ppl) <= 0.05 * readme_ppl, (ppl, readme_ppl)
    assert fresh_ppl >= 10 * ppl, (fresh_ppl, ppl)


def test_readme_fibonacci_completion(model_dir):
    """README shows the greedy completion of `def fibonacci(n):` and its newline as `deltaserve generate --dtype
    float32` makes it."""
    model = deltaserve.load_model(model_dir, dtype="float32")
    tok = deltaserve.load_tokenizer(model_dir)
    text = README.read_text(encoding="utf-8")
    m = re.search(r"<!-- fibonacci-completion -->\n```python\n(.*?)\n```", text, re.S)
    assert m, "README.md has no fibonacci completion block"
    shown = m.group(1)
    prompt = header_prompt("def fibonacci(n):")
    assert shown.startswith(prompt)
    produced = prompt + greedy_completion(model, tok, prompt, 48)
    assert produced.startswith(shown) or shown.startswith(produced)


def test_whole_held_out_perplexities(model_dir):
    """Perplexity over the whole validation text and the whole second held-out text (CPython's own tests), windows
    of 256 tokens, as `train --report` measures them: each within 5% of the README's figure and below the previous
    default model's on the same text (the README gives both)."""
    trained = deltaserve.load_model(model_dir, dtype="float32")
    tok = deltaserve.load_tokenizer(model_dir)
    for name, text in (("val-ppl-whole", corpus.validation_text()), ("cpython-tests-ppl", corpus.test_suite_text())):
        ids = tok.encode(text)
        ppl = math.exp(evaluate(trained, ids, max_tokens=len(ids)))
        shown, previous = float(_readme_figure(name)), float(_readme_figure(f"{name}-previous"))
        print(f"{name}: {ppl:.2f} (README {shown}, previous model {previous})")
        assert abs(ppl - shown) <= 0.05 * shown, (name, ppl, shown)
        assert ppl < previous, (name, ppl, previous)


def test_readme_header_completions(model_dir):
    """README shows the greedy completions (fp32, 64 tokens) of the six headers `train --report` checks, each
    prompted with its newline, exactly as produced, and says which of them parse."""
    model = deltaserve.load_model(model_dir, dtype="float32")
    tok = deltaserve.load_tokenizer(model_dir)
    prompts = [header_prompt(h) for h in FUNCTION_HEADERS]
    produced = [p + greedy_completion(model, tok, p, HEADER_COMPLETION_TOKENS) for p in prompts]
    text = README.read_text(encoding="utf-8")
    m = re.search(r"<!-- header-completions -->\n```text\n(.*?)\n```", text, re.S)
    assert m, "README.md has no header completions block"
    assert m.group(1) == "\n\n".join(produced)
    said = re.search(r"whether the function each defines parses: ([^)]*)\)", text)
    checks = [check_header_completion(p, out[len(p):]) for p, out in zip(prompts, produced)]
    assert " ".join(said.group(1).split()) == ", ".join("parses" if c["parses"] else "no" for c in checks)
