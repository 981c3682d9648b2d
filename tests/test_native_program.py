"""The native backend's programs (backends/native/program.py, native_src/stack.c) against the native modules they
stand for, bit for bit (hidden states, KDA states, checkpoints, latent pages; DSA layers to bf16 rounding: the block
computes the indexer key's LayerNorm and the gate in C) on the tiny presets of each family and on every kind of step:
pure decode (few and many rows), prefill chunks, chunks cut by a prefix-cache snapshot, MX layers, caches the
blocks cannot read, no cache; rebuilds on weight and cache changes; errors; engines whose greedy tokens through the
programs are those of the modules."""

from __future__ import annotations

import pytest
import torch

from block_utils import (assert_caches_equal, count_programs, decode_batch, native_model, program_and_module_tokens,
                         run_step, twin_caches)
from deltaserve.backends.native.program import Programs, StepKind, write_program
from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.paged_cache import PagedCache, SeqHandle
from deltaserve.cache.sequence_cache import SequenceCache
from deltaserve.cache.state_slots import StateSlots
from deltaserve.layers.batch import DraftSlot, StepBatch
from deltaserve.ops import native
from deltaserve.ops.native_contract import LINEAR_MAX_ROWS
from deltaserve.ops.opset import get_ops
from deltaserve.ops.qli import build_index_meta
from engine_utils import assert_pools_free, greedy, make_llm, random_prompts

pytestmark = pytest.mark.skipif(native.native_library() is None, reason="no C compiler to build the kernels")

DSA_PRESETS = ("k31-tiny", "deepseek-v32-tiny")


def _assert_same(got: torch.Tensor, want: torch.Tensor, dsa: bool, what: str) -> None:
    if not dsa:
        assert torch.equal(got, want), what
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2, msg=what)
    assert (got == want).float().mean() > 0.5, what


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k31-tiny", "k3-tiny", "deepseek-v32-tiny"])
@pytest.mark.parametrize("slots", [[2], [0, 3, 1], [4, 1, 2, 0]])
def test_decode_program_equals_the_modules(make_checkpoint, monkeypatch, preset, slots):
    """Three decode steps running (states and pages carried) through the program and through the modules; K3's
    AttnRes mixes and block bank are in the program too."""
    taken = count_programs(monkeypatch)
    model, backend = native_model(make_checkpoint(preset))
    program_cache, module_cache = twin_caches(model, len(slots))
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for step in range(3):
            ids = torch.randint(0, model.config.vocab_size, (len(slots),), generator=g)
            got = run_step(model, backend, ids, decode_batch(program_cache, slots, 4 + step, model.config), True)
            want = run_step(model, backend, ids, decode_batch(module_cache, slots, 4 + step, model.config), False)
            _assert_same(got, want, preset in DSA_PRESETS, f"step {step}")
            assert_caches_equal(program_cache, module_cache, keys_close=preset in DSA_PRESETS)
    assert taken == [True] * 3


@pytest.mark.parametrize("preset", DSA_PRESETS)
def test_decode_program_past_the_indexer_top_k(make_checkpoint, monkeypatch, preset):
    """Contexts of 31-34 rows against a top-k of 16: the DSA blocks score and select in C."""
    taken = count_programs(monkeypatch)
    model, backend = native_model(make_checkpoint(preset))
    program_cache, module_cache = twin_caches(model, 2, pages_per_sequence=3)
    slots = [1, 0, 3, 2]
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for step in range(2):
            ids = torch.randint(0, model.config.vocab_size, (len(slots),), generator=g)
            batches = [decode_batch(c, slots, 30 + step, model.config, pages_per_sequence=3)
                       for c in (program_cache, module_cache)]
            assert not batches[0].index_meta.all_short
            got = run_step(model, backend, ids, batches[0], True)
            want = run_step(model, backend, ids, batches[1], False)
            _assert_same(got, want, True, f"step {step}")
    assert taken == [True] * 2


WIDE_SLOTS = [[5, 0, 3, 1, 2], list(range(17, -1, -1))]


@pytest.mark.parametrize("preset, quantization, slots",
                         [(p, None, slots) for p in ("kimi-linear-tiny", "k31-tiny") for slots in WIDE_SLOTS]
                         + [(p, q, slots) for p in ("kimi-linear-tiny", "k31-tiny", "k3-tiny")
                            for q in ("w4a8-mxfp4", "w8a8-mxfp8", "mxfp") for slots in [[2], [4, 1, 2, 0], *WIDE_SLOTS]])
def test_wide_decode_program_equals_the_modules(make_checkpoint, monkeypatch, slots, preset, quantization):
    """Decode steps of 5 and 18 sequences: products on the column packs; on K3.1 the DSA layers and the latent MoE
    take more rows than their blocks, so the program runs their modules between native runs. Under each MX scheme
    (the blocks' `mx` slots hold the modules' own column matrices) from 1 sequence up; a DSA block (at most 4 rows)
    agrees to bf16 rounding, everything else bit for bit."""
    taken = count_programs(monkeypatch)
    model, backend = native_model(make_checkpoint(preset), quantization=quantization)
    sequences = max(slots) + 1
    pages = (4 + 2 + sequences) // 16 + 1  # sequence i decodes at positions 4 + i .. 6 + i
    program_cache, module_cache = twin_caches(model, len(slots), pages, sequences=sequences)
    dsa = preset in DSA_PRESETS and len(slots) <= LINEAR_MAX_ROWS
    g = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        for step in range(3):
            ids = torch.randint(0, model.config.vocab_size, (len(slots),), generator=g)
            got = run_step(model, backend, ids, decode_batch(program_cache, slots, 4 + step, model.config, pages), True)
            want = run_step(model, backend, ids, decode_batch(module_cache, slots, 4 + step, model.config, pages),
                            False)
            _assert_same(got, want, dsa, f"step {step}")
            assert_caches_equal(program_cache, module_cache, keys_close=dsa)
    assert taken == [True] * 3


def _chunk_batch(cache, snapshots, slots=(2, 0, 3), contexts=(3, 7, 0), lengths=(5, 1, 12)) -> StepBatch:
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, lengths)])
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    handles = [SeqHandle(s, torch.arange(16 * i, 16 * i + c + n))
               for i, (s, c, n) in enumerate(zip(slots, contexts, lengths))]
    write_rows = torch.cat([h.rows[c:] for h, c in zip(handles, contexts)])
    return StepBatch(positions, starts, list(contexts), cache, handles, kda_snapshots=snapshots, ops=get_ops("native"),
                     write_rows=write_rows)


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k31-tiny", "k3-tiny"])
@pytest.mark.parametrize("snapshots, kda_native", [([[(5, 0)], [], [(12, 2)]], True),
                                                   ([[(2, 0)], [], [(12, 2)]], False)])
def test_chunk_program_equals_the_modules(make_checkpoint, monkeypatch, preset, snapshots, kda_native):
    """A step of prefill chunks and a decode token (5, 1 and 12 rows): the KDA blocks take it when every snapshot
    falls at a chunk's end, the modules when one cuts a chunk; MLA layers (not a pure decode step) run their modules
    between native runs. Outputs, states, latent pages and checkpoints agree bit for bit."""
    taken = count_programs(monkeypatch)
    model, backend = native_model(make_checkpoint(preset))
    caches = twin_caches(model, 3)
    for cache in caches:
        cache.checkpoints = StateSlots(model.config, 3)
    ids = torch.randint(0, model.config.vocab_size, (18,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got = run_step(model, backend, ids, _chunk_batch(caches[0], snapshots), True)
        want = run_step(model, backend, ids, _chunk_batch(caches[1], snapshots), False)
    assert torch.equal(got, want)
    assert_caches_equal(*caches)
    assert torch.equal(caches[0].checkpoints.recurrent, caches[1].checkpoints.recurrent)
    assert torch.equal(caches[0].checkpoints.conv, caches[1].checkpoints.conv)
    assert caches[0].checkpoints.recurrent[[0, 2]].abs().sum() > 0 and caches[0].checkpoints.recurrent[1].abs().sum() == 0
    assert taken == [True]
    kind = StepKind.of(_chunk_batch(caches[0], snapshots), 18)
    assert kind == StepKind(kda=kda_native, decode=False, few=False)
    program = write_program(model, kind, backend.programs.plans, caches[0])
    kinds = [k for seg in program.segments for k in (seg.kinds or [seg.node.kind])]
    assert ("kda" in kinds) == kda_native and "mla" not in kinds and "attention-modules" in kinds


DRAFTS_PER_SLOT = 4


def _rows_batch(cache, config, seqs: list[tuple[int, int, int, int]], drafts: bool) -> StepBatch:
    """A step over sequences (state slot, first position, rows, drafts kept after its first rows) on pages 16 * slot
    onwards: each sequence's rows at its next positions, with `drafts` the KDA state kept after each of its first
    `drafts` rows (a verify step), the DSA models' indexer metadata built per row."""
    positions, starts, handles, snapshots, write = [], [0], [], [], []
    for slot, first, n, kept in seqs:
        positions += range(first, first + n)
        starts.append(starts[-1] + n)
        handles.append(SeqHandle(slot, torch.arange(16 * slot, 16 * slot + first + n)))
        write += range(16 * slot + first, 16 * slot + first + n)
        snapshots.append([(j, DraftSlot.of(slot, DRAFTS_PER_SLOT, j - 1)) for j in range(1, kept + 1)] if drafts
                         else [])
    pos = torch.tensor(positions)
    seq_ids = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([n for _, _, n, _ in seqs]))
    meta = (build_index_meta([torch.tensor([slot]) for slot, *_ in seqs], [f + n for _, f, n, _ in seqs], seq_ids,
                             pos, 16, config.index_topk) if config.has_dsa else None)
    return StepBatch(pos, starts, [f for _, f, _, _ in seqs], cache, handles, kda_snapshots=snapshots,
                     ops=get_ops("native"), index_meta=meta, write_rows=torch.tensor(write))


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k31-tiny", "k3-tiny", "deepseek-v32-tiny"])
@pytest.mark.parametrize("seqs", [[(2, 5, 4, 3)], [(1, 7, 2, 1), (3, 4, 2, 1)], [(0, 6, 1, 0), (2, 3, 3, 2)]])
def test_verify_program_is_its_rows_decoded_one_by_one(make_checkpoint, monkeypatch, preset, seqs):
    """A verify step (each sequence its newest token and the drafts after it, the KDA state kept after every row but
    the last) through one program: the KDA blocks write the draft states in C, the MLA and DSA blocks attend per row
    over the rows written before them. Its outputs, states, pages and draft states are those of the same rows run as
    decode steps one position at a time, each draft state the state after its row, bit for bit (at most 4 rows: the
    row-packed products, as at decode; index keys to bf16 rounding)."""
    taken = count_programs(monkeypatch)
    model, backend = native_model(make_checkpoint(preset))
    caches = twin_caches(model, 5)
    for cache in caches:
        cache.drafts = StateSlots(model.config, 5 * DRAFTS_PER_SLOT)
    verify, stepped = caches
    rows = sum(n for _, _, n, _ in seqs)
    ids = torch.randint(0, model.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(9))
    batch = _rows_batch(verify, model.config, seqs, drafts=True)
    assert StepKind.of(batch, rows) == StepKind(kda=True, decode=True, few=True)
    with torch.inference_mode():
        got = run_step(model, backend, ids, batch, True)
        want = torch.empty_like(got)
        offsets = [sum(n for _, _, n, _ in seqs[:i]) for i in range(len(seqs))]
        for r in range(max(n for _, _, n, _ in seqs)):
            live = [i for i, (_, _, n, _) in enumerate(seqs) if r < n]
            step = _rows_batch(stepped, model.config, [(seqs[i][0], seqs[i][1] + r, 1, 0) for i in live], False)
            picked = torch.tensor([offsets[i] + r for i in live])
            want[picked] = run_step(model, backend, ids[picked], step, True)
            for i in live:
                slot, _, _, kept = seqs[i]
                if r < kept:
                    draft = DraftSlot.of(slot, DRAFTS_PER_SLOT, r).slot
                    stepped.drafts.conv[draft] = stepped.states.conv[slot]
                    stepped.drafts.recurrent[draft] = stepped.states.recurrent[slot]
    assert torch.equal(got, want)
    assert_caches_equal(verify, stepped, keys_close=preset in DSA_PRESETS)
    assert torch.equal(verify.drafts.conv, stepped.drafts.conv)
    assert torch.equal(verify.drafts.recurrent, stepped.drafts.recurrent)
    kda = verify.states.recurrent.shape[1] > 0  # the preset has KDA layers
    kept = [DraftSlot.of(slot, DRAFTS_PER_SLOT, j).slot for slot, _, _, d in seqs for j in range(d)]
    assert all(verify.drafts.recurrent[k].abs().sum() > 0 for k in kept) or not kda
    program = write_program(model, StepKind.of(batch, rows), backend.programs.plans, verify)
    kinds = {k for seg in program.segments for k in (seg.kinds or [seg.node.kind])}
    assert ("kda" in kinds) == kda
    assert taken[0]


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k31-tiny", "k3-tiny"])
def test_wide_verify_program_equals_the_modules(make_checkpoint, monkeypatch, preset):
    """A verify step of 9 rows (products on the column packs; K3.1's DSA layers and latent MoE on their modules):
    the program's outputs, states, pages and draft states are the modules' (which cut the KDA chunks at the draft
    states and attend per row as well), bit for bit but for the index keys."""
    taken = count_programs(monkeypatch)
    model, backend = native_model(make_checkpoint(preset))
    caches = twin_caches(model, 5)
    for cache in caches:
        cache.drafts = StateSlots(model.config, 5 * DRAFTS_PER_SLOT)
    seqs = [(2, 5, 4, 3), (0, 7, 1, 0), (3, 2, 4, 3)]
    ids = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = run_step(model, backend, ids, _rows_batch(caches[0], model.config, seqs, drafts=True), True)
        want = run_step(model, backend, ids, _rows_batch(caches[1], model.config, seqs, drafts=True), False)
    assert torch.equal(got, want)
    assert_caches_equal(*caches, keys_close=preset in DSA_PRESETS)
    assert torch.equal(caches[0].drafts.conv, caches[1].drafts.conv)
    assert torch.equal(caches[0].drafts.recurrent, caches[1].drafts.recurrent)
    assert taken == [True]


def _mtp_block_twins(path, seed: int):
    """A native bf16 model, its backend and two paged caches whose MTP layer latent pages hold the same random
    rows."""
    model, backend = native_model(path)
    L = model.config.num_layers
    caches = [PagedCache(PagePool(model.config, 4, 16, torch.bfloat16, drafter_layers=(L,)),
                         StateSlots(model.config, 5)) for _ in "ab"]
    init = torch.randn(caches[0].pages.latent_rows(L).shape, generator=torch.Generator().manual_seed(seed)) * 0.1
    for cache in caches:
        cache.pages.latent_rows(L).copy_(init.to(torch.bfloat16))
    return model, backend, caches


def test_an_mtp_block_runs_as_a_program(make_checkpoint, monkeypatch):
    """The backend runs an MTP layer's block (MLA or DSA + FFN, its latent in the pool's drafter layer) as a program
    of its own: decode steps through it give the modules' outputs and pages (DSA to bf16 rounding)."""
    taken = count_programs(monkeypatch)
    model, backend, caches = _mtp_block_twins(make_checkpoint("k31-tiny"), seed=1)
    block, L = model.mtp[0].block, model.config.num_layers
    dsa = block.self_attn.indexer is not None
    slots = [1, 0, 3]
    g = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        for step in range(2):
            u = (torch.randn(len(slots), model.config.hidden_size, generator=g) * 0.5).to(torch.bfloat16)
            got = backend.run_block(block, u, decode_batch(caches[0], slots, 4 + step, model.config))
            want = block(u, decode_batch(caches[1], slots, 4 + step, model.config))
            _assert_same(got, want, dsa, f"step {step}")
            _assert_same(caches[0].pages.latent_rows(L), caches[1].pages.latent_rows(L), dsa, "latent")
    assert taken == [True, True]


def test_an_mtp_catch_up_of_several_rows_runs_as_a_program(make_checkpoint, monkeypatch):
    """The MTP proposer's catch-up (several new positions of a sequence, no KDA state: `StepBatch.decode_form`)
    runs as a program whose rows attend in the decode form: its outputs and pages are those of the rows run one
    position at a time."""
    taken = count_programs(monkeypatch)
    model, backend, caches = _mtp_block_twins(make_checkpoint("k31-tiny"), seed=3)
    block, L = model.mtp[0].block, model.config.num_layers
    assert block.self_attn.indexer is None  # K3.1's MTP block: gated MLA, bit for bit
    seqs = [(1, 5, 3), (3, 2, 1)]  # (page, first position, rows)

    def catch_up(cache, seqs, decode_form):
        positions, starts, handles, write = [], [0], [], []
        for page, first, n in seqs:
            positions += range(first, first + n)
            starts.append(starts[-1] + n)
            handles.append(SeqHandle(page, torch.arange(16 * page, 16 * page + first + n)))
            write += range(16 * page + first, 16 * page + first + n)
        return StepBatch(torch.tensor(positions), starts, [f for _, f, _ in seqs], cache, handles,
                         ops=get_ops("native"), write_rows=torch.tensor(write), decode_form=decode_form)

    u = (torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(4)) * 0.5).to(torch.bfloat16)
    assert catch_up(caches[0], seqs, False).context_rows is None  # without the flag: a prefill chunk's form
    with torch.inference_mode():
        batch = catch_up(caches[0], seqs, True)
        assert StepKind.of(batch, 4).decode
        got = backend.run_block(block, u, batch)
        want = torch.empty_like(got)
        for r, rows in enumerate([[0, 3], [1], [2]]):
            live = [(page, first + r, 1) for page, first, n in seqs if r < n]
            want[rows] = backend.run_block(block, u[rows], catch_up(caches[1], live, True))
    assert torch.equal(got, want)
    assert torch.equal(caches[0].pages.latent_rows(L), caches[1].pages.latent_rows(L))
    assert all(taken) and len(taken) == 4


def test_step_kinds(make_checkpoint):
    """What a step lets the blocks do: a decode step (few or many rows), a chunk step, a chunk cut by a snapshot; no
    kind without a cache or past the blocks' rows."""
    model, _ = native_model(make_checkpoint("kimi-linear-tiny"))
    cache = PagedCache(PagePool(model.config, 40, 16, torch.bfloat16), StateSlots(model.config, 20))
    assert StepKind.of(decode_batch(cache, [0, 1], 3, model.config), 2) == StepKind(True, True, True)
    assert StepKind.of(decode_batch(cache, list(range(5)), 3, model.config), 5) == StepKind(True, True, False)
    assert StepKind.of(_chunk_batch(cache, [[], [], []]), 18) == StepKind(True, False, False)
    assert StepKind.of(_chunk_batch(cache, [[(3, 0)], [], []]), 18) == StepKind(False, False, False)
    assert StepKind.of(StepBatch.single(3), 3) is None
    assert StepKind.of(decode_batch(cache, [0], 3, model.config), 10 ** 6) is None


def test_a_decode_program_of_native_layers_is_one_call(make_checkpoint):
    """kimi-linear-tiny's decode program is one native run; its registers are reused (a plain residual stack needs
    two: each sub-block reads one and writes the other)."""
    model, backend = native_model(make_checkpoint("kimi-linear-tiny"))
    cache = twin_caches(model, 0)[0]
    kind = StepKind.of(decode_batch(cache, [0, 1], 3, model.config), 2)
    assert kind == StepKind(kda=True, decode=True, few=True)
    program = write_program(model, kind, backend.programs.plans, cache)
    assert len(program.segments) == 1 and program.native_ops == 2 * len(model.layers)
    assert program.registers == 2


@pytest.mark.parametrize("quantization", ["w4a8-mxfp4", "mxfp"])
@pytest.mark.parametrize("snapshots", [[[(5, 0)], [], [(12, 2)]]])
def test_mx_chunk_program_equals_the_modules(make_checkpoint, monkeypatch, snapshots, quantization):
    """Prefill chunks and a decode token (18 rows) with MX layers: the KDA and FFN blocks take MX products at every
    row count, as the modules do."""
    taken = count_programs(monkeypatch)
    model, backend = native_model(make_checkpoint("kimi-linear-tiny"), quantization=quantization)
    caches = twin_caches(model, 3)
    for cache in caches:
        cache.checkpoints = StateSlots(model.config, 3)
    ids = torch.randint(0, model.config.vocab_size, (18,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got = run_step(model, backend, ids, _chunk_batch(caches[0], snapshots), True)
        want = run_step(model, backend, ids, _chunk_batch(caches[1], snapshots), False)
    assert torch.equal(got, want)
    assert_caches_equal(*caches)
    assert taken == [True]


@pytest.mark.parametrize("preset, kinds", [("kimi-linear-tiny", {"kda", "mla", "ffn"}),
                                           ("k31-tiny", {"kda", "dsa", "ffn"})])
def test_mx_layers_run_in_the_native_blocks(make_checkpoint, preset, kinds):
    """Under every MX scheme a decode step of a few sequences is one program of native blocks (KDA, MLA or DSA and
    FFN blocks over MX weights, or over bf16 attention weights under w4a8-mxfp4), with no module between them."""
    for quantization in ("w4a8-mxfp4", "w8a8-mxfp8", "mxfp"):
        model, backend = native_model(make_checkpoint(preset), quantization=quantization)
        cache = twin_caches(model, 5)[0]
        program = write_program(model, StepKind.of(decode_batch(cache, [0, 1], 4, model.config), 2),
                                backend.programs.plans, cache)
        written = [k for seg in program.segments for k in (seg.kinds or [seg.node.kind])]
        assert kinds <= set(written) and not any(k.endswith("-modules") for k in written), (quantization, written)
        assert len(program.segments) == 1


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "deepseek-v32-tiny"])
def test_a_contiguous_cache_runs_attention_on_the_modules(make_checkpoint, monkeypatch, preset):
    """A step over a SequenceCache (no slots, no pages): the program runs the FFN blocks and every attention
    sub-block's modules, with the modules' result."""
    taken = count_programs(monkeypatch)
    model, backend = native_model(make_checkpoint(preset))
    ids = torch.tensor([3, 9, 4, 7])
    outs = []
    with torch.inference_mode():
        for program in (True, False):
            cache = SequenceCache(model.config, torch.bfloat16)
            handle = cache.new_sequence()
            run_step(model, backend, ids[:3], StepBatch.single(3, 0, cache, handle), program)
            outs.append(run_step(model, backend, ids[3:], StepBatch.single(1, 3, cache, handle), program))
    assert taken == [True, True]
    assert torch.equal(outs[0], outs[1])
    program = write_program(model, StepKind.of(StepBatch.single(1, 3, cache, handle), 1), backend.programs.plans,
                            cache)
    kinds = {k for seg in program.segments for k in (seg.kinds or [seg.node.kind])}
    assert "ffn" in kinds and not kinds & {"kda", "mla", "dsa"}


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k31-tiny", "deepseek-v32-tiny"])
def test_no_cache_runs_the_modules(make_checkpoint, monkeypatch, preset):
    """The plain forward of a short sequence (no cache at all) takes no program."""
    taken = count_programs(monkeypatch)
    model, backend = native_model(make_checkpoint(preset))
    ids = torch.tensor([5, 11, 2])
    with torch.inference_mode():
        got = run_step(model, backend, ids, StepBatch.single(3), True)
        assert torch.equal(got, run_step(model, backend, ids, StepBatch.single(3), False))
    assert taken == [False]


def test_programs_follow_weight_and_cache_changes(make_checkpoint):
    """An in-place weight edit and a new cache object rewrite the program (it holds their addresses)."""
    model, backend = native_model(make_checkpoint("k3-tiny"))
    ids = torch.tensor([5])
    with torch.inference_mode():
        for change in range(3):
            if change == 1:
                model.layers[2].self_attn.o_proj.weight.mul_(2)
                model.layers[3].ffn.experts.w2.mul_(-1)
            program_cache, module_cache = twin_caches(model, change)  # new caches each round
            got = run_step(model, backend, ids, decode_batch(program_cache, [1], 5, model.config), True)
            want = run_step(model, backend, ids, decode_batch(module_cache, [1], 5, model.config), False)
            assert torch.equal(got, want), f"change {change}"
            assert_caches_equal(program_cache, module_cache)
            if change == 0:
                before = got
    assert not torch.equal(got, before)


def test_decode_program_takes_prefix_cache_snapshots(make_checkpoint, monkeypatch):
    """A decode step on which two sequences end a page (snapshots after their token) fills the checkpoints as the
    modules do."""
    taken = count_programs(monkeypatch)
    model, backend = native_model(make_checkpoint("kimi-linear-tiny"))
    caches = twin_caches(model, 4)
    for cache in caches:
        cache.checkpoints = StateSlots(model.config, 3)
    ids = torch.tensor([7, 8, 9])
    outs = []
    with torch.inference_mode():
        for cache, program in zip(caches, (True, False)):
            batch = decode_batch(cache, [0, 3, 1], 5, model.config)
            batch.kda_snapshots = [[(1, 2)], [], [(1, 0)]]
            outs.append(run_step(model, backend, ids, batch, program))
    assert taken == [True]
    assert torch.equal(outs[0], outs[1])
    assert_caches_equal(*caches)
    stacked, modules = (c.checkpoints for c in caches)
    assert torch.equal(stacked.conv, modules.conv) and torch.equal(stacked.recurrent, modules.recurrent)
    assert stacked.recurrent[[0, 2]].abs().sum() > 0 and stacked.recurrent[1].abs().sum() == 0


def test_program_rejects_a_cache_row_outside_the_pages(make_checkpoint):
    model, backend = native_model(make_checkpoint("kimi-linear-tiny"))
    cache = twin_caches(model, 0)[0]
    batch = decode_batch(cache, [0], 3, model.config)
    batch.write_rows = torch.tensor([10 ** 6])
    with torch.inference_mode(), pytest.raises(IndexError, match="native program: a mla op rejected its inputs"):
        backend.forward(model, torch.tensor([3]), batch)


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k31-tiny", "deepseek-v32-tiny"])
@pytest.mark.parametrize("lengths", [[3, 6, 4], [20, 35, 9]])
def test_engine_runs_its_steps_through_programs(make_checkpoint, monkeypatch, preset, lengths):
    """A bf16 engine on the native backend runs its prefill and decode steps through programs, with the greedy
    tokens of the modules: contexts within the tiny DSA presets' indexer top-k (16), and past it across page
    ends."""
    taken = count_programs(monkeypatch)
    path = make_checkpoint(preset)
    got, want = program_and_module_tokens(path, random_prompts(lengths, seed=6, high=700), monkeypatch)
    assert got == want
    assert taken == [True] * 8  # one prefill step, then the 7 decode steps of all three


def test_engine_decodes_many_sequences_through_programs(make_checkpoint, monkeypatch):
    """20 sequences on kimi-linear-tiny (column packs; the tile unit where there is one) with the modules' tokens."""
    rows, run = [], Programs.run

    def counted(self, model, h, batch):
        out = run(self, model, h, batch)
        if out is not None:
            rows.append(h.shape[0])
        return out

    monkeypatch.setattr(Programs, "run", counted)
    path = make_checkpoint("kimi-linear-tiny")
    got, want = program_and_module_tokens(path, random_prompts([3 + 2 * i for i in range(20)], seed=4, high=700),
                                          monkeypatch)
    assert got == want
    assert len(rows) >= 7 and max(rows) >= 16


def test_checkpoints_from_programs_serve_later_prefix_hits(make_checkpoint, monkeypatch):
    """Steps that end a page snapshot the KDA states inside the program; a second round whose prompts extend the
    first round's sequences resumes from those checkpoints, with the tokens of an engine on the modules."""
    taken = count_programs(monkeypatch)
    path = make_checkpoint("kimi-linear-tiny")
    prompts = random_prompts([9, 30], seed=8, high=700)
    runs, hits = [], []
    for program in (True, False):
        with monkeypatch.context() as m:
            if not program:
                m.setattr(Programs, "run", lambda self, model, h, batch: None)
            llm = make_llm(path, dtype="bfloat16", backend="native")
            first = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
            longer = [p + list(t) + [5, 6] for p, t in zip(prompts, first)]  # 9 + 12 crosses 16, 30 + 12 crosses 32
            second = [o.outputs[0].token_ids for o in llm.generate(longer, greedy(4), use_tqdm=False)]
            runs.append((first, second))
            hits.append(llm.engine.core.prefix.num_hit_tokens)
            assert_pools_free(llm.engine)
    assert runs[0] == runs[1]
    assert hits[0] == hits[1] >= 16 + 32
    assert taken.count(True) >= 11
