"""Greedy generation for one prompt on the plain forward with a per-sequence cache (until the engine lands)."""

from collections.abc import Iterator
from pathlib import Path

import torch

from .cache.sequence_cache import SequenceCache
from .layers.batch import StepBatch
from .models.loader import load_model
from .tokenizer import load_tokenizer


@torch.no_grad()
def greedy_generate(path: Path, prompt: str, max_tokens: int, dtype: str = "float32") -> Iterator[str]:
    """Yield the decoded text of each new token until EOS or `max_tokens`."""
    model = load_model(path, dtype=dtype)
    tok = load_tokenizer(path)
    stop = set(tok.stop_token_ids(model.config.eos_token_ids))
    ids = torch.tensor(tok.encode(prompt), dtype=torch.long)
    cache = SequenceCache(model.config)
    seq = cache.new_sequence()
    decoder = tok.incremental_decoder()
    context = 0
    for _ in range(max_tokens):
        h = model(ids, StepBatch.single(ids.shape[0], context, cache, seq))
        context += ids.shape[0]
        nxt = int(model.compute_logits(h[-1:]).argmax(-1))
        if nxt in stop:
            break
        yield decoder.feed(nxt)
        ids = torch.tensor([nxt])
    yield decoder.flush()
