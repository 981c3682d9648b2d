"""Train a small K3.1-architecture model (KDA + DSA + AttnRes + latent MoE) on Python source (the standard library and
permissively licensed packages, deltaserve.tools.corpus) and write it in the real checkpoint layout. Used once to
produce the shipped default model (deltaserve/data/); the export's training.json records the corpus's packages,
versions and licences.

    python -m deltaserve.tools.train --out deltaserve/data/default_model --work /tmp/k31-train

Steps: (1) corpus (deltaserve.tools.corpus), (2) byte-level BPE trained with `tokenizers`, exported as
``tiktoken.model`` + ``tokenizer_config.json`` (kimi_k3 specials) and the equivalent ``tokenizer.json``, (3) AdamW +
cosine LR on random windows of the token stream, deterministic given ``--seed``; ``--work`` holds
``state.safetensors`` (model, optimiser, RNG, step) written every ``--ckpt-every`` steps, and the run resumes from it.
Every checkpoint also exports the model folder through the normal writer (``make_model.checkpoint_tensors``), so an
interrupted run still leaves usable weights.
"""

from __future__ import annotations

import argparse
import ast
import base64
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ModelConfig
from ..layers.batch import StepBatch
from ..layers.quantized import get_scheme
from ..ops.indexer import indexer_scores_ref
from ..tokenizer.base import CHAR_TO_BYTE
from .make_model import _save_sharded, build_random, checkpoint_tensors
from .presets import get_preset
from .quant_noise import QuantNoise
from .tokenizer_files import _bpe_parts, tokenizer_config
from .tokenizer_json import write_tokenizer_json

# ----------------------------------------------------------------------------------------------------------------
# Tokenizer


def train_bpe_ranks(docs: list[str], num_bpe_ranks: int) -> dict[bytes, int]:
    """Byte-level BPE learned by `tokenizers`, as tiktoken ranks: bytes 0..255, then merged tokens in merge order.

    Pre-tokenisation uses the Kimi split regex, so the merges fit how tiktoken splits. A merge result that is a
    duplicate or that tiktoken's rank-ordered BPE would never produce from its bytes is dropped (every written
    token is reachable), and the list is cut at ``num_bpe_ranks``.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from ..tokenizer import KIMI_PAT_STR

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=num_bpe_ranks + 512, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(docs, trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    ranks = {bytes([b]): b for b in range(256)}
    for m in merges:
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        merged = bytes(CHAR_TO_BYTE[c] for c in a + b)
        if merged in ranks or _bpe_parts(merged, ranks) != 2:
            continue
        ranks[merged] = len(ranks)
        if len(ranks) == num_bpe_ranks:
            break
    if len(ranks) < num_bpe_ranks:
        raise ValueError(f"corpus gave only {len(ranks)} reachable tokens, asked for {num_bpe_ranks}")
    return ranks


def write_tokenizer(out: Path, ranks: dict[bytes, int], max_len: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode('ascii')} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (out / "tiktoken.model").write_text("".join(lines), encoding="ascii", newline="\n")
    cfg = tokenizer_config("kimi_k3", len(ranks), model_max_length=max_len)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8", newline="\n")


# ----------------------------------------------------------------------------------------------------------------
# Model, batches, evaluation


def build_model(raw_config: dict, seed: int) -> tuple[torch.nn.Module, ModelConfig]:
    config = ModelConfig.from_dict(json.loads(json.dumps(raw_config)))
    return build_random(config, seed), config


def step_batch(num_seqs: int, seq_len: int) -> StepBatch:
    """Layout of ``num_seqs`` fresh sequences of ``seq_len`` tokens each, flattened."""
    return StepBatch(torch.arange(seq_len).repeat(num_seqs), [i * seq_len for i in range(num_seqs + 1)],
                     [0] * num_seqs)


def forward_windows(model: torch.nn.Module, windows: torch.Tensor):
    """The main stack over ``windows`` [B, T+1] (each row an independent sequence): inputs x and next tokens y
    [B * T], pre-norm states h [B * T, d] and the layout."""
    B, T1 = windows.shape
    x, y = windows[:, :-1].reshape(-1), windows[:, 1:].reshape(-1)
    layout = step_batch(B, T1 - 1)
    return x, y, model(x, layout), layout


def sequence_loss(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over ``windows`` [B, T+1] (each row an independent sequence)."""
    _, y, h, _ = forward_windows(model, windows)
    return F.cross_entropy(model.compute_logits(h), y)


def one_back(h: torch.Tensor, seq_len: int) -> torch.Tensor:
    """States [B * seq_len, d] moved one position later within each window, zero at its first position: what an
    MTP layer reads beside token t."""
    d = h.shape[-1]
    return F.pad(h.view(-1, seq_len, d)[:, :-1], (0, 0, 1, 0)).reshape(-1, d)


def mtp_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, batch: StepBatch,
             seq_len: int) -> torch.Tensor:
    """Mean cross-entropy of the MTP layers over flattened windows (x, y [B * seq_len] inputs and next tokens, h the
    main stack's pre-norm states), as they draft at inference (docs/model.md §13): layer k at position t reads the
    embedding of token t and the state one position back (the main stack's for k = 1, layer k - 1's after it), so
    it predicts token t + 1 from what was known at t - 1: the token after next. Positions t < k have no such state
    (it is zero there, and the embedding is zeroed at position 0) and are not scored."""
    embeds = model.embed_tokens(x)
    prev, total = h, h.new_zeros((), dtype=torch.float32)
    for k, layer in enumerate(model.mtp, start=1):
        prev = layer(embeds, one_back(prev, seq_len), batch.positions, batch)
        scored = batch.positions >= k
        total = total + F.cross_entropy(layer.logits(prev)[scored], y[scored])
    return total / max(1, len(model.mtp))


class IndexerInputs:
    """Forward pre-hooks on every attention layer with a lightning indexer: each layer's input of the last
    forward, detached (the indexer learns beside the model, not through it), for `indexer_loss`."""

    def __init__(self, model: torch.nn.Module):
        from ..layers.mla import MLAttention

        self.layers = [m for m in model.modules() if isinstance(m, MLAttention) and m.indexer is not None]
        self.inputs: dict[int, torch.Tensor] = {}
        self.hooks = [m.register_forward_pre_hook(self._keep) for m in self.layers]

    def _keep(self, module, args) -> None:
        self.inputs[id(module)] = args[0].detach()

    def take(self) -> list[tuple[torch.nn.Module, torch.Tensor]]:
        """(layer, input) of the layers the last forward ran, and forget them."""
        out = [(m, self.inputs.pop(id(m))) for m in self.layers if id(m) in self.inputs]
        self.inputs.clear()
        return out

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


def attention_mass(layer: torch.nn.Module, q_nope: torch.Tensor, q_pe: torch.Tensor, latent_rows: torch.Tensor,
                   seq_len: int) -> torch.Tensor:
    """An MLA layer's full causal attention distribution over keys from its projections (`_project`), heads
    averaged (each head's softmax summed and L1-normalised, what DSA trains its indexer against): [B, T, T] for the
    B windows of `seq_len` rows."""
    H, n, r = layer.H, layer.n, layer.r
    k_nope = F.linear(latent_rows[:, :r], layer.kv_b_proj.weight).view(-1, H, n + layer.v)[..., :n]
    B = q_nope.shape[0] // seq_len
    w = lambda t: t.reshape(B, seq_len, *t.shape[1:]).float()
    scores = (torch.einsum("bthn,bshn->bhts", w(q_nope), w(k_nope))
              + torch.einsum("bthr,bsr->bhts", w(q_pe), w(latent_rows[:, r:]))) * layer.scale
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1).mean(1)


def indexer_loss(taken: list[tuple[torch.nn.Module, torch.Tensor]], batch: StepBatch, seq_len: int) -> torch.Tensor:
    """Mean over layers, windows and queries of KL(attention mass || softmax of the indexer's scores) over each
    query's causal keys (DeepSeek-V3.2's indexer objective in its dense form): the gradient reaches only the indexer,
    whose inputs (the layer input and the MLA's c_q) are detached."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    total = torch.zeros(())
    for layer, x in taken:
        with torch.no_grad():
            q_nope, q_pe, latent_rows, c_q, cos_sin = layer._project(x, batch)
            p = attention_mass(layer, q_nope, q_pe, latent_rows, seq_len)
        iq, ik, iw = layer.indexer.project(x, c_q, cos_sin)
        for b in range(p.shape[0]):
            rows = slice(b * seq_len, (b + 1) * seq_len)
            log_q = indexer_scores_ref(iq[rows], ik[rows], iw[rows]).masked_fill(~causal, float("-inf")).log_softmax(-1)
            kl = torch.where(causal, p[b] * (p[b].clamp(min=1e-30).log() - log_q), 0.0).sum(-1).mean()
            total = total + kl / (p.shape[0] * len(taken))
    return total


@torch.no_grad()
def mtp_agreement(model: torch.nn.Module, ids: torch.Tensor, seq_len: int = 256, windows: int = 4) -> float:
    """How often the first MTP layer's top-1 token at position t (drafted from the state at t - 1 and token t)
    equals the main model's greedy choice at t, over the first `windows` windows of `seq_len` tokens of `ids`,
    positions t >= 1: the acceptance a one-token MTP draft would see under greedy verification."""
    if not len(model.mtp):
        return float("nan")
    x = ids[:windows * seq_len]
    layout = step_batch(len(x) // seq_len, seq_len)
    h = model(x, layout)
    layer = model.mtp[0]
    draft = layer.logits(layer(model.embed_tokens(x), one_back(h, seq_len), layout.positions, layout)).argmax(-1)
    scored = layout.positions >= 1
    return (draft == model.compute_logits(h).argmax(-1))[scored].float().mean().item()


@torch.no_grad()
def indexer_recall(model: torch.nn.Module, ids: torch.Tensor, context: int = 1024) -> float:
    """The share of each query's full attention mass (heads averaged) that its lightning indexer's top-k selection
    keeps, over one window of `context` tokens of `ids`: the mean over every DSA layer and every query with more
    causal keys than the top-k (fewer select all of them)."""
    from ..ops.indexer import select_topk, selection_mask

    inputs = IndexerInputs(model)
    layout = StepBatch.single(context)
    model(ids[:context], layout)
    taken = inputs.take()
    inputs.close()
    topk = model.config.index_topk
    shares = []
    for layer, x in taken:
        q_nope, q_pe, rows, c_q, cos_sin = layer._project(x, layout)
        p = attention_mass(layer, q_nope, q_pe, rows, context)[0]
        iq, ik, iw = layer.indexer.project(x, c_q, cos_sin)
        kept = selection_mask(select_topk(indexer_scores_ref(iq, ik, iw), layout.positions, topk), context)
        shares.append((p * kept).sum(-1)[topk:].mean().item())
    return sum(shares) / max(1, len(shares))


@torch.no_grad()
def expert_load(model: torch.nn.Module, ids: torch.Tensor, seq_len: int = 256, windows: int = 16) -> list[float]:
    """Each router's max/mean expert load (1 = even) over the first `windows` windows of `seq_len` tokens of `ids`:
    how many of the tokens' top-k picks each expert got, as serving would route them."""
    from ..layers.moe import Router

    counts: dict[int, torch.Tensor] = {}

    def count(router, _inputs, routing) -> None:
        c = torch.bincount(routing.experts.reshape(-1), minlength=router.e_score_correction_bias.numel())
        counts[id(router)] = counts.get(id(router), 0) + c

    routers = [m for m in model.modules() if isinstance(m, Router)]
    hooks = [r.register_forward_hook(count) for r in routers]
    try:
        model.eval()
        x = ids[:windows * seq_len]
        model(x, step_batch(len(x) // seq_len, seq_len))
    finally:
        for hook in hooks:
            hook.remove()
    return [(counts[id(r)].max() / counts[id(r)].float().mean()).item() for r in routers if id(r) in counts]


# Small function headers a user tries first; the report and tests/test_default_model.py check their greedy completions.
FUNCTION_HEADERS = ("def add(a, b):", "def is_even(n):", "def factorial(n):", "def reverse_string(s):",
                    "def mean(values):", "def count_words(text):")
HEADER_COMPLETION_TOKENS = 64


def header_prompt(header: str) -> str:
    """The prompt for a header's completion: the header and the newline after it, as an editor has it when the body
    is to be written. The tokenizer's pre-split keeps a colon and the newlines after it in one piece ("):\n" is one
    token), so a prompt that stops at the colon asks for what follows a colon inside a line, not a body."""
    return header + "\n"


def greedy_completion(model: torch.nn.Module, tok, prompt: str, max_tokens: int) -> str:
    """The greedy continuation of ``prompt`` (no BOS, as `deltaserve generate` sends it), one full forward per token
    through the reference path: what an fp32 model produces, independent of the engine."""
    ids, out = tok.encode(prompt), []
    model.eval()
    with torch.no_grad():
        for _ in range(max_tokens):
            out.append(int(model.reference_logits(torch.tensor(ids + out)).float()[-1].argmax()))
    return tok.decode(out)


def function_body(header: str, completion: str) -> str:
    """The function that ``header`` + ``completion`` defines (the header with or without its newline): the header line
    and the lines after it that are blank or indented, up to the first that is neither; when the completion ends
    inside the function, its last line (which the token limit may have cut) is dropped."""
    first, *rest = (header + completion).split("\n")
    body, ended = [], False
    for line in rest:
        if line.strip() and not line[0].isspace():
            ended = True
            break
        body.append(line)
    if not ended and body:
        body.pop()
    return "\n".join([first, *body]).rstrip() + "\n"


def check_header_completion(header: str, completion: str) -> dict:
    """Whether the function a completion gives parses as Python with a body (`ast`), and how often its most repeated
    non-blank line occurs in the whole completion (a looping model repeats one line)."""
    text = function_body(header, completion)
    try:
        parses = len(ast.parse(text).body[0].body) > 0
    except SyntaxError:
        parses = False
    lines = [line.strip() for line in (header + completion).split("\n")[:-1] if line.strip()]
    return {"parses": parses, "max_line_repeats": max((lines.count(line) for line in lines), default=0)}


def report(model_dir: Path) -> dict:
    """The shipped figures of a trained model folder, each from the model as it loads (fp32): perplexity over the
    whole validation and CPython test-suite texts (windows of 256 tokens), the first MTP layer's agreement with
    the greedy token (16 validation windows of 256), the lightning indexers' top-k recall of the attention mass at
    a 1,024-token context (mean of 4 validation windows), each router's max/mean expert load (16 windows) and the
    greedy completions of `FUNCTION_HEADERS` with their checks."""
    from ..models.loader import load_model
    from ..tokenizer import load_tokenizer
    from . import corpus

    model = load_model(model_dir, dtype="float32")
    tok = load_tokenizer(model_dir)
    val = torch.as_tensor(tok.encode(corpus.validation_text()))
    tests = torch.as_tensor(tok.encode(corpus.test_suite_text()))
    return {"validation_ppl": math.exp(evaluate(model, val, max_tokens=len(val))),
           "cpython_tests_ppl": math.exp(evaluate(model, tests, max_tokens=len(tests))),
           "mtp_greedy_agreement": mtp_agreement(model, val, windows=16),
           "indexer_recall_1k": sum(indexer_recall(model, val[i * 1024:], 1024) for i in range(4)) / 4,
           "expert_load_max_over_mean": [round(v, 3) for v in expert_load(model, val)],
           "function_headers": [{"prompt": (p := header_prompt(h)),
                                 "completion": (c := greedy_completion(model, tok, p, HEADER_COMPLETION_TOKENS)),
                                 **check_header_completion(p, c)} for h in FUNCTION_HEADERS]}


class LoadBalancer:
    """Auxiliary-loss-free expert balancing (DeepSeek-V3): every router's top-k choices of a step are counted
    (a forward hook), and after the step each expert's correction bias moves by `rate` towards equal loads: up
    for experts chosen less than the mean, down for those chosen more. The bias only ranks experts (the combine
    weights come from the scores without it), so it balances the load without a loss term pulling on the model."""

    def __init__(self, model: torch.nn.Module, rate: float):
        from ..layers.moe import Router

        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.counts: dict[int, torch.Tensor] = {}
        self.hooks = [r.register_forward_hook(self._count) for r in self.routers]

    def _count(self, router, _inputs, routing) -> None:
        if not router.training:  # evaluation forwards between steps must not move the biases
            return
        counts = torch.bincount(routing.experts.reshape(-1), minlength=router.e_score_correction_bias.numel())
        self.counts[id(router)] = self.counts.get(id(router), 0) + counts

    @torch.no_grad()
    def step(self) -> float:
        """Moves the biases by this step's counts; returns the step's worst max/mean expert load (1 = even)."""
        worst = 1.0
        for r in self.routers:
            counts = self.counts.pop(id(r), None)
            if counts is None:
                continue
            load = counts.float()
            r.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            worst = max(worst, (load.max() / load.mean().clamp(min=1e-9)).item())
        return worst

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


@torch.no_grad()
def evaluate(model: torch.nn.Module, ids: list[int] | torch.Tensor, seq_len: int = 256, max_tokens: int = 4096,
             seqs_per_step: int = 4) -> float:
    """Mean next-token loss (nats) on the first windows of ``ids``: consecutive non-overlapping windows of
    ``seq_len`` + 1 tokens (stride ``seq_len``), ``max_tokens // seq_len`` of them; exp() of it is perplexity."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    n = min(max_tokens // seq_len, (len(ids) - 1) // seq_len)
    windows = torch.stack([ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    model.eval()
    total = 0.0
    for s in range(0, n, seqs_per_step):
        w = windows[s : s + seqs_per_step]
        total += sequence_loss(model, w).item() * w.shape[0]
    return total / n


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints


def export_model(model: torch.nn.Module, config: ModelConfig, raw_config: dict, tokenizer_dir: Path, out: Path,
                 dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> Path:
    """Write the model folder (config.json, model.safetensors, the tokenizer files of ``tokenizer_dir`` and the
    tokenizer.json made from them) through the normal writer.
    Written beside ``out`` and swapped in, so a crash never leaves a half-written folder."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    raw = json.loads(json.dumps(raw_config))
    dt = "bfloat16" if dtype == torch.bfloat16 else "float32"
    raw["torch_dtype"] = dt
    raw.get("text_config", raw)["torch_dtype"] = dt
    _save_sharded(checkpoint_tensors(model, config, dtype), tmp, 2 << 30)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, tmp / name)
    write_tokenizer_json(tmp)
    if extra:
        (tmp / "training.json").write_text(json.dumps(extra, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def _atomic_save(tensors: dict[str, torch.Tensor], meta: dict, path: Path) -> None:
    """Tensors to safetensors and everything else to JSON in the header (never pickle), replaced atomically."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"json": json.dumps(meta)})
    os.replace(tmp, path)


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["json"])
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def _source_weights(source: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The fp32 weights of a run's state.safetensors (exactly) or of a model folder (its bf16 weights widened), and
    what it records of its training (the state's progress, the folder's training.json)."""
    if source.is_dir():
        from ..models.loader import load_model

        record = source / "training.json"
        return (load_model(source, dtype="float32").state_dict(),
                json.loads(record.read_text()) if record.exists() else {})
    tensors, meta = _load(source)
    return {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, meta


def _mean_weights(sources: list[Path]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The mean of the sources' fp32 weights (each a state or a model folder, of one shape) and what each records."""
    total, metas = None, []
    for source in sources:
        weights, meta = _source_weights(source)
        total = weights if total is None else {k: v + weights[k] for k, v in total.items()}
        metas.append(meta)
    return {k: v / len(sources) for k, v in total.items()}, metas


def load_initial_weights(model: torch.nn.Module, sources: list[Path]) -> list[dict]:
    """Start a new stage from earlier weights: each source is a run's state.safetensors or a model folder (e.g. the
    shipped default model) of the same shape; several sources start from the mean of their weights (a model soup:
    runs that branched from one model stay in one basin, and their mean is often better than each). The optimiser
    and LR schedule start afresh. Returns what training.json records of each source: {"from", "step",
    "tokens_seen"}."""
    weights, metas = _mean_weights(sources)
    model.load_state_dict(weights)
    return [{"from": source.name, "step": meta.get("step"), "tokens_seen": meta.get("tokens_seen")}
            for source, meta in zip(sources, metas)]


def average_models(sources: list[Path], out: Path) -> Path:
    """Write ``out`` as the mean of model folders' weights (a model soup), in the first folder's config and
    tokenizer; its training.json lists each folder's (their shapes must agree: the loader checks every tensor)."""
    raw = json.loads((sources[0] / "config.json").read_text())
    model, config = build_model(raw, 0)
    weights, records = _mean_weights(sources)
    model.load_state_dict(weights)
    dtype = torch.float32 if raw.get("torch_dtype") == "float32" else torch.bfloat16
    return export_model(model, config, raw, sources[0], out, dtype=dtype,
                        extra={"average_of": [{"from": d.name, **r} for d, r in zip(sources, records)]})


def _save_training_state(path: Path, model, opt, gen: torch.Generator, info: dict,
                         noise_gen: torch.Generator | None = None) -> None:
    """Model, AdamW moments and step counts, the RNG states (the data order's, torch's, and quantisation noise's when
    it runs), and progress: everything a resume needs."""
    opt_sd = opt.state_dict()
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for idx, st in opt_sd["state"].items():
        for key, value in st.items():
            tensors[f"opt.{idx}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    tensors["rng.gen"] = gen.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    if noise_gen is not None:
        tensors["rng.noise"] = noise_gen.get_state()
    _atomic_save(tensors, {"param_groups": opt_sd["param_groups"], **info}, path)


def _load_training_state(path: Path, model, opt, gen: torch.Generator,
                         noise_gen: torch.Generator | None = None) -> dict:
    tensors, meta = _load(path)
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, idx, key = k.split(".", 2)
            state.setdefault(int(idx), {})[key] = v
    opt.load_state_dict({"state": state, "param_groups": meta.pop("param_groups")})
    gen.set_state(tensors["rng.gen"])
    torch.set_rng_state(tensors["rng.torch"])
    if noise_gen is not None:
        noise_gen.set_state(tensors["rng.noise"])
    return meta


# ----------------------------------------------------------------------------------------------------------------
# Training loop


def lr_at(step: int, steps: int, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def train(model: torch.nn.Module, tokens: torch.Tensor, *, steps: int, batch: int, seq_len: int, lr: float,
          seed: int, warmup: int = 20, weight_decay: float = 0.1, clip: float = 1.0, state_path: Path | None = None,
          ckpt_every: int = 0, on_checkpoint=None, deadline: float | None = None, stop_at: int | None = None,
          progress: bool = True, log: list | None = None, mtp_weight: float = 0.3, balance_rate: float = 1e-3,
          indexer_weight: float = 1.0, quant_noise: QuantNoise | None = None) -> dict:
    """Train in place on random windows of ``tokens``; deterministic in ``seed``; resumes from ``state_path``.
    The loss is the next-token cross-entropy plus ``mtp_weight`` times the MTP layers' (`mtp_loss`; none without
    them) plus ``indexer_weight`` times the lightning indexers' (`indexer_loss`, which trains only them); the routers'
    correction biases follow the load (`LoadBalancer`, ``balance_rate``; 0: frozen). With ``quant_noise`` each step
    runs a fresh draw of its layers fake-quantised (tools/quant_noise.py).

    Returns {"step", "tokens_seen", "seconds", "losses" (next-token), "mtp_losses", "indexer_losses",
    "load_imbalance" (each step's worst max/mean expert load)}. Stops early (after a checkpoint) at ``deadline``
    (time.time() value) or after step ``stop_at``; the LR schedule always follows ``steps``."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    noise_gen = quant_noise.gen if quant_noise is not None else None
    step, seconds, losses, mtp_losses, indexer_losses, imbalance = 0, 0.0, [], [], [], []
    if state_path is not None and state_path.exists():
        st = _load_training_state(state_path, model, opt, gen, noise_gen)
        step, seconds, losses = st["step"], st["seconds"], st["losses"]
        mtp_losses, imbalance = st.get("mtp_losses", []), st.get("load_imbalance", [])
        indexer_losses = st.get("indexer_losses", [])
    balancer = LoadBalancer(model, balance_rate) if balance_rate else None
    indexer_inputs = IndexerInputs(model) if indexer_weight else None

    def checkpoint() -> None:
        info = {"step": step, "tokens_seen": step * batch * seq_len, "seconds": seconds, "losses": losses,
                "mtp_losses": mtp_losses, "indexer_losses": indexer_losses, "load_imbalance": imbalance}
        if state_path is not None:
            _save_training_state(state_path, model, opt, gen, info, noise_gen)
        if on_checkpoint is not None:
            on_checkpoint(info)

    model.train()
    bar = tqdm(total=steps, initial=step, disable=not progress, dynamic_ncols=True, unit="step")
    n = len(tokens) - seq_len - 1
    while step < steps:
        t0 = time.perf_counter()
        starts = torch.randint(0, n, (batch,), generator=gen)
        windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        if quant_noise is not None:
            quant_noise.draw()
        x, y, h, layout = forward_windows(model, windows)
        loss = F.cross_entropy(model.compute_logits(h), y)
        total = loss
        if mtp_weight and len(model.mtp):
            extra = mtp_loss(model, x, y, h, layout, seq_len)
            total = loss + mtp_weight * extra
            mtp_losses.append(round(extra.item(), 4))
        if indexer_inputs is not None:
            taken = indexer_inputs.take()
            if taken:
                kl = indexer_loss(taken, layout, seq_len)
                total = total + indexer_weight * kl
                indexer_losses.append(round(kl.item(), 4))
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if balancer is not None:
            imbalance.append(round(balancer.step(), 3))
        step += 1
        dt = time.perf_counter() - t0
        seconds += dt
        losses.append(round(loss.item(), 4))
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{batch * seq_len / dt:.0f}",
                        lr=f"{opt.param_groups[0]['lr']:.2e}")
        if log is not None:
            log.append(loss.item())
        last = step == steps or step == stop_at or (deadline is not None and time.time() > deadline)
        if (ckpt_every and step % ckpt_every == 0) or last:
            checkpoint()
        if last:
            break
    bar.close()
    for hooks in (balancer, indexer_inputs):
        if hooks is not None:
            hooks.close()
    return {"step": step, "tokens_seen": step * batch * seq_len, "seconds": seconds, "losses": losses,
            "mtp_losses": mtp_losses, "indexer_losses": indexer_losses, "load_imbalance": imbalance}


# ----------------------------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> None:
    from ..tokenizer import load_tokenizer
    from . import corpus

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k31-stdlib", help="shape preset (deltaserve.tools.presets)")
    ap.add_argument("--out", type=Path, default=corpus.DATA_DIR / "default_model")
    ap.add_argument("--work", type=Path, default=Path("/tmp/deltaserve-train"), help="state, tokens, tokenizer")
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--deadline", type=str, default=None, help="stop after this UTC time, HH:MM (checkpointed)")
    ap.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                    help="stop after this step (checkpointed); the LR schedule still follows --steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP layers' loss (none without them)")
    ap.add_argument("--indexer-weight", type=float, default=1.0,
                    help="weight of the lightning indexers' KL to the attention mass (trains only them; 0: frozen)")
    ap.add_argument("--balance-rate", type=float, default=1e-3,
                    help="router correction-bias step per training step towards equal expert loads (0: frozen)")
    ap.add_argument("--report", type=Path, default=None, metavar="MODEL_DIR",
                    help="print a trained model folder's figures (perplexities, MTP agreement, indexer recall, "
                         "expert load) as JSON and exit")
    ap.add_argument("--write-validation", action="store_true",
                    help="(re)write deltaserve/data/validation.txt and deltaserve/data/cpython_tests.txt")
    ap.add_argument("--corpus", choices=corpus.CORPORA, default="core",
                    help="core: the standard library and PACKAGES; extended: also EXTRA_PACKAGES with their tests "
                         "(deltaserve.tools.corpus)")
    ap.add_argument("--init", type=Path, nargs="+", default=None, metavar="STATE_OR_MODEL",
                    help="start from the weights of an earlier run's state.safetensors or of a model folder of the "
                         "same shape, or from the mean of several (a new stage: fresh optimiser and LR schedule); "
                         "ignored once this run's own state exists")
    ap.add_argument("--average", type=Path, nargs="+", default=None, metavar="MODEL_DIR",
                    help="write --out as the mean of these model folders' weights (a model soup; the tokenizer is "
                         "the first folder's) and exit; its training.json keeps each folder's")
    ap.add_argument("--quant-noise", type=float, default=0.0, metavar="P",
                    help="each step, run each layer that --quant-noise-scheme quantises fake-quantised with "
                         "probability P (0: never)")
    ap.add_argument("--quant-noise-scheme", default="mxfp", help="the quantization scheme whose layers get noise")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="take tiktoken.model and tokenizer_config.json from this model folder instead of learning "
                         "BPE (keeps per-token perplexities comparable with that model's)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.report is not None:
        print(json.dumps(report(args.report), indent=2))
        return

    if args.average is not None:
        average_models(args.average, args.out)
        print(f"{args.out}: the mean of {len(args.average)} models' weights")
        return

    preset = get_preset(args.preset)
    raw = preset.config
    args.work.mkdir(parents=True, exist_ok=True)
    if args.write_validation or not corpus.VALIDATION_PATH.exists():
        corpus.DATA_DIR.mkdir(parents=True, exist_ok=True)
        corpus.VALIDATION_PATH.write_text(corpus.build_validation_text(), encoding="utf-8")
        corpus.TEST_SUITE_PATH.write_text(corpus.build_test_suite_text(), encoding="utf-8")
    tok_dir = args.work / "tokenizer"
    if args.tokenizer is not None and not (tok_dir / "tiktoken.model").exists():
        tok_dir.mkdir(parents=True, exist_ok=True)
        for name in ("tiktoken.model", "tokenizer_config.json"):
            shutil.copyfile(args.tokenizer / name, tok_dir / name)
    if not (tok_dir / "tiktoken.model").exists():
        t0 = time.time()
        docs = corpus.training_documents(args.corpus)
        ranks = train_bpe_ranks(docs, preset.num_bpe_ranks)
        write_tokenizer(tok_dir, ranks, raw["text_config"]["model_max_length"])
        print(f"tokenizer: {len(ranks)} BPE ranks from {len(docs)} files in {time.time() - t0:.0f}s")
    tokenizer = load_tokenizer(tok_dir)
    tok_path = args.work / "tokens.safetensors"
    if not tok_path.exists():
        docs = corpus.training_documents(args.corpus)
        ids: list[int] = []
        sep = tokenizer.encode(corpus.FILE_SEP)
        for d in docs:
            ids += tokenizer.encode(d) + sep
        _atomic_save({"tokens": torch.tensor(ids, dtype=torch.int32)}, {}, tok_path)
        print(f"corpus: {len(docs)} files, {sum(len(d.encode()) for d in docs)} bytes, {len(ids)} tokens")
    tokens = _load(tok_path)[0]["tokens"].long()
    val_ids = tokenizer.encode(corpus.validation_text())

    model, config = build_model(raw, args.seed)
    stage = {}
    if args.init is not None:
        records = load_initial_weights(model, args.init)
        stage["init"] = records[0] if len(records) == 1 else records
    noise = QuantNoise.attach(model, get_scheme(args.quant_noise_scheme), args.quant_noise, args.seed) \
        if args.quant_noise else None
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params; {len(tokens)} training tokens")
    deadline = None
    if args.deadline:
        import datetime as _dt
        hh, mm = map(int, args.deadline.split(":"))
        now = _dt.datetime.now(_dt.timezone.utc)
        deadline = now.replace(hour=hh, minute=mm, second=0, microsecond=0).timestamp()

    sources = corpus.manifest(args.corpus)  # recorded with every export: what it was trained on, under which licences

    def last50(values: list[float], digits: int = 4) -> float:
        return round(sum(values[-50:]) / max(1, len(values[-50:])), digits)

    def on_checkpoint(info: dict) -> None:
        # every figure in eval mode: forwards in training mode would count towards the routers' next bias step
        val = evaluate(model, val_ids, max_tokens=2048)
        recall = indexer_recall(model, torch.as_tensor(val_ids), 1024)
        agreement = mtp_agreement(model, torch.as_tensor(val_ids))
        model.train()
        extra = {"step": info["step"], "tokens_seen": info["tokens_seen"], "train_seconds": round(info["seconds"]),
                 "seed": args.seed, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
                 "steps_planned": args.steps, "val_loss_2048": round(val, 4),
                 "train_loss_last50": last50(info["losses"]), "mtp_weight": args.mtp_weight,
                 "balance_rate": args.balance_rate, "indexer_weight": args.indexer_weight,
                 "indexer_loss_last50": last50(info["indexer_losses"]), "indexer_recall_1k": round(recall, 4),
                 "mtp_greedy_agreement": round(agreement, 4), "mtp_loss_last50": last50(info["mtp_losses"]),
                 "load_imbalance_last50": last50(info["load_imbalance"], 3), "quant_noise": args.quant_noise,
                 "quant_noise_scheme": args.quant_noise_scheme if args.quant_noise else None, **stage,
                 "corpus": sources}
        export_model(model, config, raw, tok_dir, args.out, extra=extra)
        print(f"\ncheckpoint step {info['step']}: val loss {val:.3f} (ppl {math.exp(val):.1f}) -> {args.out}",
              flush=True)

    res = train(model, tokens, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                seed=args.seed, warmup=args.warmup, state_path=args.work / "state.safetensors",
                ckpt_every=args.ckpt_every, on_checkpoint=on_checkpoint, deadline=deadline, stop_at=args.stop_at,
                mtp_weight=args.mtp_weight, balance_rate=args.balance_rate, indexer_weight=args.indexer_weight,
                quant_noise=noise)
    print(f"done: {res['step']} steps, {res['tokens_seen']} tokens, {res['seconds']:.0f}s")


if __name__ == "__main__":
    main()
