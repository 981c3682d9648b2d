"""Shared by the native-program tests: a bf16 model given its native forms, two caches with the same random states
and pages, a pure decode step over them, one step run through the native backend's program or through the native
modules alone, and engines of both kinds."""

from __future__ import annotations

import torch

from deltaserve.backends.native import NativeBackend
from deltaserve.backends.native.program import Programs
from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.paged_cache import PagedCache, SeqHandle
from deltaserve.cache.state_slots import StateSlots
from deltaserve.layers.batch import StepBatch
from deltaserve.models.decoder import Eager
from deltaserve.models.loader import load_model
from deltaserve.ops.opset import get_ops
from deltaserve.ops.qli import build_index_meta
from engine_utils import assert_pools_free, greedy, make_llm


def native_model(path, **kw):
    """(bf16 model in its native forms, its native backend)."""
    model = load_model(path, dtype="bfloat16", **kw)
    backend = NativeBackend("tests")
    assert "native forms for 0 " not in backend.prepare(model)
    return model, backend


def run_step(model, backend, ids: torch.Tensor, batch: StepBatch, program: bool) -> torch.Tensor:
    """The step's final hidden states through the backend (its program, where one takes the step) or through the
    native modules alone."""
    if program:
        return backend.forward(model, ids, batch)
    return model.run_layers(model.embed_tokens(ids), Eager(batch))


def count_programs(monkeypatch) -> list[bool]:
    """Records, for every step the native backend sees, whether a program took it."""
    taken, run = [], Programs.run

    def counted(self, model, h, batch):
        out = run(self, model, h, batch)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(Programs, "run", counted)
    return taken


def twin_caches(model, seed: int, pages_per_sequence: int = 1, sequences: int = 4) -> list[PagedCache]:
    """Two caches with the same random KDA states, latent pages and index keys (room for `sequences` sequences of
    16 tokens a page)."""
    g = torch.Generator().manual_seed(seed)
    caches = [PagedCache(PagePool(model.config, sequences * pages_per_sequence, 16, torch.bfloat16),
                         StateSlots(model.config, sequences + 1)) for _ in "ab"]
    pools = [(c.states.conv, c.states.recurrent, *(c.pages.latent_rows(l) for l in c.pages.latent),
              *(c.pages.key_rows(l)[0] for l in c.pages.index_keys)) for c in caches]
    for first, second in zip(*pools):
        init = (torch.randn(first.shape, generator=g) * 0.1).to(first.dtype)
        first.copy_(init)
        second.copy_(init)
    return caches


def assert_caches_equal(a: PagedCache, b: PagedCache, keys_close: bool = False) -> None:
    """States and pages equal bit for bit (index keys to a bf16 step with `keys_close`: the DSA block's LayerNorm
    runs in C)."""
    assert torch.equal(a.states.conv, b.states.conv) and torch.equal(a.states.recurrent, b.states.recurrent)
    for layer in a.pages.latent:
        assert torch.equal(a.pages.latent_rows(layer), b.pages.latent_rows(layer)), f"layer {layer} latent"
    for layer in a.pages.index_keys:
        got, want = a.pages.key_rows(layer)[0], b.pages.key_rows(layer)[0]
        if keys_close:
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        else:
            assert torch.equal(got, want), f"layer {layer} index keys"


def decode_batch(cache: PagedCache, slots: list[int], position: int, config, pages_per_sequence: int = 1) -> StepBatch:
    """Sequence i (state slot slots[i]) owns pages i * pages_per_sequence onwards (16 rows each) and decodes its
    token at position + i (contexts differ); DSA models get the step's indexer metadata. The step runs the native op
    set: the fused blocks and the decode stack compute what the modules compute on the native kernels, bit for bit,
    so the modules must take those kernels too."""
    N, span = len(slots), 16 * pages_per_sequence
    positions = [position + i for i in range(N)]
    handles = [SeqHandle(s, torch.arange(span * i, span * i + p + 1)) for i, (s, p) in enumerate(zip(slots, positions))]
    write_rows = torch.tensor([span * i + p for i, p in enumerate(positions)])
    tables = [torch.arange(pages_per_sequence * i, pages_per_sequence * (i + 1)) for i in range(N)]
    meta = (build_index_meta(tables, [p + 1 for p in positions], torch.arange(N), torch.tensor(positions), 16,
                             config.index_topk) if config.has_dsa else None)
    return StepBatch(torch.tensor(positions), list(range(N + 1)), positions, cache, handles, ops=get_ops("native"),
                     index_meta=meta, write_rows=write_rows)


def program_and_module_tokens(path, prompts: list[list[int]], monkeypatch, max_tokens: int = 8) -> tuple[list, list]:
    """Greedy tokens of each prompt from a bf16 engine on the native backend, and from one whose programs are off
    (the native modules run every step); both engines' pools are checked free afterwards."""
    runs = []
    for program in (True, False):
        with monkeypatch.context() as m:
            if not program:
                m.setattr(Programs, "run", lambda self, model, h, batch: None)
            llm = make_llm(path, dtype="bfloat16", backend="native")
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(max_tokens), use_tqdm=False)])
            assert_pools_free(llm.engine)
    return runs[0], runs[1]
