"""The whole decoder stack's decode step as one native call (layers/fused_stack.py, native_src/stack.c) against the
layers run one by one through their fused blocks, bit for bit (hidden states, KDA states, latent and index-key
pages) on the tiny presets of each family; where it steps aside; its rebuild when weights or the cache change;
and an engine whose greedy tokens through the stack are those of the modules."""

from __future__ import annotations

import pytest
import torch

from block_utils import decode_batch, fused_and_module_tokens, native_model, twin_caches
from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.paged_cache import PagedCache, SeqHandle
from deltaserve.cache.sequence_cache import SequenceCache
from deltaserve.cache.state_slots import StateSlots
from deltaserve.layers import fused_attention
from deltaserve.layers.batch import StepBatch
from deltaserve.layers.fused_blocks import attention_block
from deltaserve.layers.fused_stack import DecodeStack
from deltaserve.models import decoder
from deltaserve.ops import native
from engine_utils import assert_pools_free, greedy, make_llm, random_prompts

pytestmark = pytest.mark.skipif(native.native_library() is None, reason="no C compiler to build the kernels")


def _count_stack_runs(monkeypatch) -> list[bool]:
    """Records, for every call of DecodeStack.run, whether the stack took the step."""
    taken, run = [], DecodeStack.run

    def counted(self, model, h, batch):
        out = run(self, model, h, batch)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(DecodeStack, "run", counted)
    return taken


def _step(model, cache, slots, position, ids, stack: bool) -> torch.Tensor:
    model.fuse_stack = stack
    return model(ids, decode_batch(cache, slots, position, model.config))


def _assert_caches_equal(a: PagedCache, b: PagedCache) -> None:
    assert torch.equal(a.states.conv, b.states.conv) and torch.equal(a.states.recurrent, b.states.recurrent)
    for layer in a.pages.latent:
        assert torch.equal(a.pages.latent_rows(layer), b.pages.latent_rows(layer)), f"layer {layer} latent"
    for layer in a.pages.index_keys:
        assert torch.equal(a.pages.key_rows(layer)[0], b.pages.key_rows(layer)[0]), f"layer {layer} index keys"


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k31-tiny", "deepseek-v32-tiny"])
@pytest.mark.parametrize("slots", [[2], [0, 3, 1], [4, 1, 2, 0]])
def test_stack_equals_the_layers_bit_for_bit(make_checkpoint, monkeypatch, preset, slots):
    """Three decode steps running (states and pages carried) through the stack and through the layers' blocks;
    K3's AttnRes mixes and block bank are in the program too."""
    taken = _count_stack_runs(monkeypatch)
    model = native_model(make_checkpoint(preset))
    stack_cache, layer_cache = twin_caches(model, len(slots))
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for step in range(3):
            ids = torch.randint(0, model.config.vocab_size, (len(slots),), generator=g)
            got = _step(model, stack_cache, slots, 4 + step, ids, True)
            want = _step(model, layer_cache, slots, 4 + step, ids, False)
            assert torch.equal(got, want), f"step {step}"
            _assert_caches_equal(stack_cache, layer_cache)
    assert taken == [True] * 3


@pytest.mark.parametrize("preset", ["k31-tiny", "deepseek-v32-tiny"])
def test_stack_equals_the_layers_past_the_indexer_top_k(make_checkpoint, monkeypatch, preset):
    """Contexts of 31-34 rows against a top-k of 16: the DSA blocks select inside the stack as they do alone."""
    taken = _count_stack_runs(monkeypatch)
    model = native_model(make_checkpoint(preset))
    stack_cache, layer_cache = twin_caches(model, 2, pages_per_sequence=3)
    slots = [1, 0, 3, 2]
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for step in range(2):
            ids = torch.randint(0, model.config.vocab_size, (len(slots),), generator=g)
            batches = [decode_batch(c, slots, 30 + step, model.config, pages_per_sequence=3)
                       for c in (stack_cache, layer_cache)]
            assert not batches[0].index_meta.all_short
            model.fuse_stack = True
            got = model(ids, batches[0])
            model.fuse_stack = False
            want = model(ids, batches[1])
            assert torch.equal(got, want), f"step {step}"
            _assert_caches_equal(stack_cache, layer_cache)
    assert taken == [True] * 2


@pytest.mark.parametrize("slots", [[5, 0, 3, 1, 2], list(range(17, -1, -1))])
def test_wide_stack_equals_the_layers_bit_for_bit(make_checkpoint, monkeypatch, slots):
    """Decode steps of 5 and 18 sequences take kimi-linear-tiny's stack (its products on the column packs above 4
    rows) with the layers' results, states and pages."""
    taken = _count_stack_runs(monkeypatch)
    model = native_model(make_checkpoint("kimi-linear-tiny"))
    pages = (4 + 2 + len(slots)) // 16 + 1  # sequence i decodes at positions 4 + i .. 6 + i
    stack_cache, layer_cache = twin_caches(model, len(slots), pages, sequences=len(slots))
    g = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        for step in range(3):
            ids = torch.randint(0, model.config.vocab_size, (len(slots),), generator=g)
            model.fuse_stack = True
            got = model(ids, decode_batch(stack_cache, slots, 4 + step, model.config, pages))
            model.fuse_stack = False
            want = model(ids, decode_batch(layer_cache, slots, 4 + step, model.config, pages))
            assert torch.equal(got, want), f"step {step}"
            _assert_caches_equal(stack_cache, layer_cache)
    assert taken == [True] * 3


def test_stack_steps_aside_where_a_block_would(make_checkpoint, monkeypatch):
    """More rows than the blocks take, a prefill chunk, a layer with its blocks off and a switch off: the layers
    run (and give the same result as with the stack off)."""
    taken = _count_stack_runs(monkeypatch)
    monkeypatch.setattr(fused_attention, "BLOCK_MAX_ROWS", 4)  # read when the plans are gathered
    model = native_model(make_checkpoint("kimi-linear-tiny"))
    cache = PagedCache(PagePool(model.config, 8, 16, torch.bfloat16), StateSlots(model.config, 8))
    with torch.inference_mode():
        model(torch.arange(5), decode_batch(cache, [0, 1, 2, 3, 4], 3, model.config))  # 5 rows > 4
        model(torch.arange(2), StepBatch.single(2, 3, cache, SeqHandle(0, torch.arange(5))))  # a prefill chunk
        model.layers[1].fuse_blocks = False
        model(torch.arange(1), decode_batch(cache, [0], 3, model.config))
        model.layers[1].fuse_blocks = True
        model.layers[2].ffn.experts.native = False
        model(torch.arange(1), decode_batch(cache, [0], 3, model.config))
        model.layers[2].ffn.experts.native = True
        model(torch.arange(1), decode_batch(cache, [0], 3, model.config))
    assert taken == [False, False, False, False, True]


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "deepseek-v32-tiny"])
def test_stack_and_blocks_step_aside_on_a_contiguous_cache(make_checkpoint, monkeypatch, preset):
    """A decode step over a SequenceCache (no slots, no pages) runs the modules, with their result."""
    taken = _count_stack_runs(monkeypatch)
    model = native_model(make_checkpoint(preset))
    ids = torch.tensor([3, 9, 4, 7])
    outs = []
    with torch.inference_mode():
        for fuse in (True, False):
            model.fuse_stack = fuse
            for layer in model.layers:
                layer.fuse_blocks = fuse
            cache = SequenceCache(model.config, torch.bfloat16)
            handle = cache.new_sequence()
            model(ids[:3], StepBatch.single(3, 0, cache, handle))
            outs.append(model(ids[3:], StepBatch.single(1, 3, cache, handle)))
    assert taken == [False, False]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k31-tiny", "deepseek-v32-tiny"])
def test_a_few_tokens_without_a_cache_run_the_modules(make_checkpoint, preset):
    """The reference forward of a short sequence (no cache at all) takes neither the stack nor the blocks."""
    model = native_model(make_checkpoint(preset))
    ids = torch.tensor([5, 11, 2])
    with torch.inference_mode():
        fused = model.reference_logits(ids)
        model.fuse_stack = False
        for layer in model.layers:
            layer.fuse_blocks = False
        assert torch.equal(fused, model.reference_logits(ids))


def test_stack_follows_weight_and_cache_changes(make_checkpoint):
    """An in-place weight edit and a new cache object rebuild the program (it holds their addresses)."""
    model = native_model(make_checkpoint("k31-tiny"))
    ids = torch.tensor([5])
    with torch.inference_mode():
        for change in range(3):
            if change == 1:
                model.layers[2].self_attn.o_proj.weight.mul_(2)
                model.layers[3].ffn.experts.w2.mul_(-1)
            stack_cache, layer_cache = twin_caches(model, change)  # new caches each round
            got = _step(model, stack_cache, [1], 5, ids, True)
            want = _step(model, layer_cache, [1], 5, ids, False)
            assert torch.equal(got, want), f"change {change}"
            _assert_caches_equal(stack_cache, layer_cache)
            if change == 0:
                before = got
    assert not torch.equal(got, before)


@pytest.mark.parametrize("stack", [True, False])
def test_fused_paths_take_prefix_cache_snapshots(make_checkpoint, monkeypatch, stack):
    """A decode step on which two sequences end a page (prefix-cache snapshots after their token) runs through the
    stack, or the blocks layer by layer, and fills the checkpoints as the modules do (which take those rows through
    the varlen KDA path)."""
    taken, blocks = _count_stack_runs(monkeypatch), []
    monkeypatch.setattr(decoder, "attention_block", lambda *a: blocks.append(attention_block(*a)) or blocks[-1])
    model = native_model(make_checkpoint("kimi-linear-tiny"))
    caches = twin_caches(model, 4)
    for cache in caches:
        cache.checkpoints = StateSlots(model.config, 3)
    slots = [0, 3, 1]
    ids = torch.tensor([7, 8, 9])
    outs = []
    with torch.inference_mode():
        for cache, fuse in zip(caches, (True, False)):
            model.fuse_stack = fuse and stack
            for layer in model.layers:
                layer.fuse_blocks = fuse
            batch = decode_batch(cache, slots, 5, model.config)
            batch.kda_snapshots = [[(1, 2)], [], [(1, 0)]]
            outs.append(model(ids, batch))
    assert taken == ([True] if stack else [])
    assert all(b is not None for b in blocks) and len(blocks) == (0 if stack else len(model.layers))
    assert torch.equal(outs[0], outs[1])
    _assert_caches_equal(*caches)
    stacked, modules = (c.checkpoints for c in caches)
    assert torch.equal(stacked.conv, modules.conv) and torch.equal(stacked.recurrent, modules.recurrent)
    assert stacked.recurrent[[0, 2]].abs().sum() > 0 and stacked.recurrent[1].abs().sum() == 0


def test_stack_rejects_a_cache_row_outside_the_pages(make_checkpoint):
    model = native_model(make_checkpoint("kimi-linear-tiny"))
    cache = twin_caches(model, 0)[0]
    batch = decode_batch(cache, [0], 3, model.config)
    batch.write_rows = torch.tensor([10 ** 6])
    with torch.inference_mode(), pytest.raises(IndexError, match="decode stack: op .* rejected its inputs"):
        model(torch.tensor([3]), batch)


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k31-tiny", "deepseek-v32-tiny"])
@pytest.mark.parametrize("lengths", [[3, 6, 4], [20, 35, 9]])
def test_engine_decode_runs_through_the_stack(make_checkpoint, monkeypatch, preset, lengths):
    """A bf16 engine's decode steps take the stack, and its greedy tokens are those of the modules (stack and
    blocks off): contexts within the tiny DSA presets' indexer top-k (16), and past it across page ends."""
    taken = _count_stack_runs(monkeypatch)
    path = make_checkpoint(preset)
    fused, modules = fused_and_module_tokens(path, random_prompts(lengths, seed=6, high=700), stack=True)
    assert fused == modules
    assert taken == [False] + [True] * 7  # one prefill step, then the 7 decode steps of all three


def test_engine_decodes_many_sequences_through_the_stack(make_checkpoint, monkeypatch):
    """20 sequences decoding on kimi-linear-tiny take the stack (column packs, tile unit where there is
    one) with the modules' greedy tokens."""
    rows, run = [], DecodeStack.run

    def counted(self, model, h, batch):
        out = run(self, model, h, batch)
        if out is not None:
            rows.append(h.shape[0])
        return out

    monkeypatch.setattr(DecodeStack, "run", counted)
    path = make_checkpoint("kimi-linear-tiny")
    fused, modules = fused_and_module_tokens(path, random_prompts([3 + 2 * i for i in range(20)], seed=4, high=700),
                                             stack=True)
    assert fused == modules
    assert len(rows) >= 7 and max(rows) >= 16  # the scheduler staggers the prefills: up to 16 decode at once


def test_decode_checkpoints_from_the_stack_serve_later_prefix_hits(make_checkpoint, monkeypatch):
    """Decode steps that end a page take the stack and snapshot the KDA states; a second round whose prompts extend
    the first round's sequences resumes from those checkpoints, with the tokens of an engine on the modules."""
    taken = _count_stack_runs(monkeypatch)
    path = make_checkpoint("kimi-linear-tiny")
    prompts = random_prompts([9, 30], seed=8, high=700)
    runs, hits = [], []
    for fuse in (True, False):
        llm = make_llm(path, dtype="bfloat16")
        llm.engine.model.fuse_stack = fuse
        for layer in llm.engine.model.layers:
            layer.fuse_blocks = fuse
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
        longer = [p + list(t) + [5, 6] for p, t in zip(prompts, first)]  # 9 + 12 crosses 16, 30 + 12 crosses 32
        second = [o.outputs[0].token_ids for o in llm.generate(longer, greedy(4), use_tqdm=False)]
        runs.append((first, second))
        hits.append(llm.engine.core.prefix.num_hit_tokens)
        assert_pools_free(llm.engine)
    assert runs[0] == runs[1]
    assert hits[0] == hits[1] >= 16 + 32  # both sequences resumed from a checkpoint taken during decode
    assert taken.count(True) >= 11  # the decode steps of the first round, page ends included
