"""Convert a `deltaserve make-model` checkpoint to GGUF with llama.cpp's own converter, plus the fixes it needs.

    python benchmarks/peers/convert_gguf.py LLAMA_CPP_DIR CHECKPOINT OUT.gguf [--outtype bf16]

LLAMA_CPP_DIR is a llama.cpp source tree holding `convert_hf_to_gguf.py` (e.g. `vendor/llama.cpp` of the
llama-cpp-python sdist: `pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36` and unpack it). Run it
with a Python that has torch, transformers, numpy and safetensors (the project's .venv does).

Fixes applied (everything else is llama.cpp's converter unchanged):

1. Pre-tokenizer. The converter names the pre-tokenizer by hashing the ids its test string encodes to, and knows
   only released tokenizers' hashes. `make-model` writes a tiktoken table learned on its own corpus with the
   Kimi-K2 split pattern (`deltaserve.tokenizer.KIMI_PAT_STR`), so the hash is new and the converter stops with
   "BPE pre-tokenizer was not recognized". For a `tiktoken.model` checkpoint of the kimi families the unknown hash
   is mapped to `kimi-k2`, the pre-tokenizer llama.cpp implements for exactly that pattern.
2. Router activation. llama.cpp's kimi-linear loader requires `expert_gating_func`, which the converter writes only
   from a config key (`moe_router_activation_func` and its aliases); released Kimi-Linear configs carry
   `"moe_router_activation_func": "sigmoid"`, the `kimi-linear-*` presets leave it to transformers' default
   (sigmoid). Without it llama.cpp fails to load the GGUF (missing key `kimi-linear.expert_gating_func`). The
   converter reads a view folder (weights and tokenizer symlinked) whose config.json adds the key.
3. deepseek_v32 only: the converter asserts `add_bos_token: true` in tokenizer_config.json (DeepSeek-V3.2's own file
   has it; make-model's does not). The view folder's tokenizer_config.json adds it.

Not a conversion fix but a limit of llama.cpp's runtime: its DSA indexer rotates indexer queries and keys with a
Hadamard matrix of at least 64, so a deepseek_v32 checkpoint needs index_head_dim a multiple of 64 (it aborts with
GGML_ASSERT(ggml_can_mul_mat(a, b)) otherwise); the deepseek-v32-* presets use 64.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import tempfile
from pathlib import Path

ROUTER_KEYS = ("score_function", "scoring_func", "score_func", "moe_router_activation",
               "moe_router_activation_func", "expert_selection_fn")


def checkpoint_view(checkpoint: Path, tmp: Path) -> Path:
    """`checkpoint` itself, or a view folder (files symlinked) whose config.json / tokenizer_config.json carry
    the keys the converter needs (fixes 2 and 3)."""
    config = json.loads((checkpoint / "config.json").read_text())
    tok_path = checkpoint / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text()) if tok_path.exists() else {}
    changed = {}
    if config.get("model_type") == "kimi_linear" and not any(k in config for k in ROUTER_KEYS):
        config["moe_router_activation_func"] = "sigmoid"  # transformers' KimiLinearConfig default
        changed["config.json"] = config
    if config.get("model_type") == "deepseek_v32" and not tok.get("add_bos_token"):
        tok["add_bos_token"] = True  # DeepSeek-V3.2's own tokenizer_config has it; the converter asserts it
        changed["tokenizer_config.json"] = tok
    if not changed:
        return checkpoint
    view = tmp / checkpoint.name
    view.mkdir()
    for f in checkpoint.iterdir():
        if f.name not in changed:
            (view / f.name).symlink_to(f.resolve())
    for name, data in changed.items():
        (view / name).write_text(json.dumps(data, indent=2) + "\n")
    return view


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("llama_cpp_dir")
    p.add_argument("checkpoint")
    p.add_argument("outfile")
    p.add_argument("--outtype", default="bf16")
    args, rest = p.parse_known_args(argv)
    src = Path(args.llama_cpp_dir).resolve()
    sys.path[:0] = [str(src), str(src / "gguf-py")]

    from conversion import base  # llama.cpp's converter package

    original = base.TextModel.get_vocab_base_pre
    kimi_tiktoken = (Path(args.checkpoint) / "tiktoken.model").exists()

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not kimi_tiktoken:
                raise
            base.logger.warning("unknown pre-tokenizer hash for a tiktoken checkpoint: using kimi-k2 (fix 1)")
            return "kimi-k2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = checkpoint_view(Path(args.checkpoint).resolve(), Path(tmp))
        sys.argv = [str(src / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", args.outtype,
                    "--outfile", args.outfile, *rest]
        runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
