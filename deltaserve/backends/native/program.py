"""A step of the decoder stack as a program of native blocks, with the modules of the layers the blocks cannot take
in between (native_src/stack.c runs each run of consecutive native ops in one call).

At batch 1 the Python and torch glue between native kernels (argument checks, ctypes, output tensors, small ops)
is a sizeable share of a step. A program writes a step's sub-blocks and AttnRes mixes, in the order the model's
forward makes them, as op records over a register file of [N, d] row sets; each run of native ops is one call.

The program is written by running the model's own stack (`CausalLM.run_layers`) on a `ProgramWriter`, which records
each sub-block instead of computing it: so the program has the model's structure by construction. Which sub-blocks
are native is decided when the program is written, per kind of step (`StepKind`): a block whose form the kernels
compute on that kind of step (backends/native/blocks.py), over caches in a layout they read, becomes a native op;
any other sub-block (a quantised layer, an MLA layer on a prefill step, a KDA layer on a step whose prefix-cache
snapshot cuts a chunk) becomes a call of its modules on the registers. A program is rebuilt when the cache object or
a weight it reads changes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ...layers.batch import DraftSlot, StepBatch
from ...layers.derived import Derived
from ...layers.moe import MoE
from ...models.decoder import AttnResQuery, DecoderLayer, Eager
from ...ops import native
from ...ops.native_contract import (LINEAR_MAX_ROWS, MAX_MIX_SOURCES, SOP_DSA, SOP_FFN, SOP_KDA, SOP_MIX, SOP_MLA,
                                   StackOp, StackStep)
from .blocks import BLOCK_MAX_ROWS, Plan, address, attention_plan, ffn_plan

_OPS = {"kda": SOP_KDA, "mla": SOP_MLA, "dsa": SOP_DSA, "ffn": SOP_FFN}
_ERRORS = {"mla": IndexError, "dsa": IndexError, "ffn": ValueError}


class StepKind(NamedTuple):
    """What a step lets the blocks do. `kda`: every sequence's prefix-cache snapshots fall at the end of its rows
    (KDA blocks; draft states may follow any row); `decode`: a decode or verify step over a paged cache, each
    sequence one token and its drafts (MLA and DSA blocks); `few`: at most LINEAR_MAX_ROWS rows (DSA blocks, K3's
    latent-MoE FFN)."""

    kda: bool
    decode: bool
    few: bool

    @classmethod
    def of(cls, batch: StepBatch, rows: int) -> "StepKind | None":
        """The step's kind, or None when no program runs it (no cache: a plain forward; more rows than a block
        takes)."""
        if batch.cache is None or not 0 < rows <= BLOCK_MAX_ROWS:
            return None
        decode = batch.context_rows is not None and batch.write_rows is not None
        return cls(batch.kda_sequences is not None, decode, rows <= LINEAR_MAX_ROWS)

    def takes(self, plan: Plan) -> bool:
        """The block of `plan` runs on steps of this kind."""
        if plan.kind == "kda":
            return self.kda
        if plan.kind == "mla":
            return self.decode
        if plan.kind == "dsa":
            return self.decode and self.few
        return plan.max_rows == BLOCK_MAX_ROWS or self.few


@dataclass
class _Node:
    """One recorded sub-block or mix: the values it reads and the value it writes (value 0: the embedded input).
    `op` is the native op record (registers filled in at allocation), or None for a call of the modules."""

    # "kda", "mla", "dsa", "ffn", "mix" (native); "attention-modules", "ffn-modules", "mix-modules"; "reduce" (a
    # tensor-parallel rank's partial sub-block output all-reduced, then added to its residual)
    kind: str
    inputs: list[int]
    out: int
    op: StackOp | None = None
    layer: DecoderLayer | None = None
    query: AttnResQuery | None = None
    residual: bool = False
    in_regs: list[int] = field(default_factory=list)  # the registers of `inputs` and `out`, once allocated
    out_reg: int = -1


class ProgramWriter:
    """Records the sub-blocks `CausalLM.run_layers` applies (models/decoder.py `SubBlocks`) over value numbers."""

    def __init__(self, kind: StepKind, plans: "LayerPlans", cache):
        self.kind, self.plans, self.cache = kind, plans, cache
        self.nodes: list[_Node] = []
        self.values = 1
        self.keep: list = []
        self.kda_modules: list = []  # the KDA layers run as native ops (their snapshots are copied after the run)

    def _value(self) -> int:
        self.values += 1
        return self.values - 1

    def _sub_block(self, plan: Plan | None, modules_kind: str, layer: DecoderLayer, x: int,
                   residual: int | None) -> int:
        """The sub-block as a native op, or a call of the modules. On a rank of a tensor-parallel group the op
        writes the rank's partial output and a "reduce" node all-reduces it and adds the residual (the modules do
        both themselves); blocks that need the other ranks inside the kernel stay on the modules."""
        sharded = layer.shard.size > 1
        if sharded and plan is not None and not _takes_a_shard(plan):
            plan = None
        out = self._value()
        inputs = [x] if residual is None else [x, residual]
        fields = _cache_fields(plan, self.cache) if plan is not None and self.kind.takes(plan) else None
        desc = plan.descriptor() if fields is not None else None
        if desc is None:
            self.nodes.append(_Node(modules_kind, inputs, out, layer=layer, residual=residual is not None))
            return out
        self.keep.append(desc)
        if plan.kind == "kda":
            self.kda_modules.append(plan.module)
        op = StackOp(kind=_OPS[plan.kind], descriptor=desc.address, **fields)
        if not sharded:
            self.nodes.append(_Node(plan.kind, inputs, out, op=op, residual=residual is not None))
            return out
        partial = out
        self.nodes.append(_Node(plan.kind, [x], partial, op=op))
        out = self._value()
        self.nodes.append(_Node("reduce", [partial] + inputs[1:], out, layer=layer, residual=residual is not None))
        return out

    def attention(self, layer: DecoderLayer, x: int, residual: int | None) -> int:
        return self._sub_block(self.plans.attention(layer), "attention-modules", layer, x, residual)

    def ffn(self, layer: DecoderLayer, x: int, residual: int | None) -> int:
        return self._sub_block(self.plans.ffn(layer), "ffn-modules", layer, x, residual)

    def mix(self, query: AttnResQuery, sources: list[int]) -> int:
        if len(sources) == 1:
            return sources[0]
        out = self._value()
        if not (_mix_on_native(query) and len(sources) <= MAX_MIX_SOURCES):
            self.nodes.append(_Node("mix-modules", list(sources), out, query=query))
            return out
        op = StackOp(kind=SOP_MIX, query=query.proj.weight[0].data_ptr(), norm_w=query.norm.weight.data_ptr(),
                     eps=query.eps, nsources=len(sources))
        self.nodes.append(_Node("mix", list(sources), out, op=op))
        return out


def _takes_a_shard(plan: Plan) -> bool:
    """A block whose kernel runs a tensor-parallel rank's part alone: not a DSA layer's indexer (its top-k needs
    every rank's scores), a latent MoE (its norm needs every rank's latent sum) or experts placed across ranks."""
    if plan.kind == "dsa":
        return plan.module.indexer is None
    if plan.kind == "ffn" and isinstance(plan.module, MoE):
        return not (plan.module.latent or plan.module.expert_parallel)
    return True


def _mix_on_native(query: AttnResQuery) -> bool:
    """The query's weights are what the native mix takes (bf16, contiguous, [d])."""
    q, w = query.proj.weight[0], query.norm.weight
    return q.dtype == w.dtype == torch.bfloat16 and q.is_contiguous() and w.is_contiguous() and q.shape == w.shape


def _cache_fields(plan: Plan, cache) -> dict | None:
    """The op's cache fields (`StackOp`), or None when the cache is not in a layout the block reads."""
    if plan.kind == "kda":
        pools = kda_pools(plan.module, cache)
        drafts = cache.kda_draft_pool(plan.module.layer)
        if pools is None or (drafts is not None and not _kda_layout(plan.module, *drafts)):
            return None
        fields = dict(conv=pools[0].data_ptr(), conv_stride=pools[0].stride(0), rec=pools[1].data_ptr(),
                      rec_stride=pools[1].stride(0))
        if drafts is not None:
            fields.update(draft_conv=drafts[0].data_ptr(), draft_conv_stride=drafts[0].stride(0),
                          draft_rec=drafts[1].data_ptr(), draft_rec_stride=drafts[1].stride(0))
        return fields
    if plan.kind == "mla":
        latent = mla_pages(plan.module, cache)
        return None if latent is None else _page_fields(latent)
    if plan.kind == "dsa":
        pages = dsa_pages(plan.module, cache)
        if pages is None:
            return None
        latent, keys = pages
        fields = _page_fields(latent)
        if keys is not None:  # a layer with an indexer
            fields.update(keys=keys.data_ptr(), ldk=keys.stride(0), keys_bf16=int(keys.dtype == torch.bfloat16))
        return fields
    return {}


def _page_fields(t: torch.Tensor) -> dict:
    return dict(pages=t.data_ptr(), ld=t.stride(0), nrows=t.shape[0], pages_bf16=int(t.dtype == torch.bfloat16))


def kda_pools(attn, cache) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layer's conv and recurrent slot pools when they are in the layout the block reads."""
    pool = cache.kda_slot_pool(attn.layer)
    return pool if pool is not None and _kda_layout(attn, *pool) else None


def _kda_layout(attn, conv: torch.Tensor, rec: torch.Tensor) -> bool:
    """Conv and recurrent state pools ([slots, 3, P, W-1], [slots, H, K, K]) in the fp32 CPU layout the block reads."""
    P, W, K = attn.P, attn.W, attn.K
    return (conv.dtype == torch.float32 and rec.dtype == torch.float32 and conv.device.type == "cpu"
            and conv.stride()[1:] == (P * (W - 1), W - 1, 1) and rec.stride()[1:] == (K * K, K, 1))


def _page_rows(t, width: int) -> bool:
    """A plain bf16/fp32 CPU page tensor of rows of `width` (not an 8-bit cache)."""
    return (isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float32) and t.device.type == "cpu"
            and t.stride(-1) == 1 and t.shape[-1] == width)


def mla_pages(attn, cache) -> torch.Tensor | None:
    """The layer's latent page rows when they are plain bf16/fp32 rows the block reads (not an 8-bit cache, not a
    cache that stores sequences contiguously)."""
    pages = cache.mla_pages(attn.layer)
    return pages[0] if pages is not None and _page_rows(pages[0], attn.r + attn.rho) else None


def dsa_pages(attn, cache) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The layer's latent and index-key page rows when both are plain bf16/fp32 rows (no keys for a layer without
    an indexer)."""
    pages = cache.mla_pages(attn.layer)
    if pages is None:
        return None
    latent, keys, scales = pages
    if attn.indexer is None:  # K3's MLA on the DSA block: the latent rows only
        return (latent, None) if _page_rows(latent, attn.r + attn.rho) else None
    if scales is not None or not (_page_rows(latent, attn.r + attn.rho) and _page_rows(keys, attn.indexer.head_dim)):
        return None
    return latent, keys


class LayerPlans:
    """Every layer's block plans, gathered at first use (None: the sub-block is never native)."""

    def __init__(self):
        self._attention: dict[int, Plan | None] = {}
        self._ffn: dict[int, Plan | None] = {}

    def attention(self, layer: DecoderLayer) -> Plan | None:
        if id(layer) not in self._attention:
            self._attention[id(layer)] = attention_plan(layer.self_attn, layer.input_layernorm)
        return self._attention[id(layer)]

    def ffn(self, layer: DecoderLayer) -> Plan | None:
        if id(layer) not in self._ffn:
            self._ffn[id(layer)] = ffn_plan(layer.ffn, layer.post_attention_layernorm, layer.config)
        return self._ffn[id(layer)]

    def sources(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """Every weight a program of `model` may read: its blocks' and its AttnRes queries'."""
        found = []
        for layer in model.layers:
            for plan in (self.attention(layer), self.ffn(layer)):
                found += plan.sources if plan is not None else []
        for module in model.modules():
            if isinstance(module, AttnResQuery):
                found += [module.proj.weight, module.norm.weight]
        return found


@dataclass
class _Segment:
    """A run of native ops (`ops`, one call) or one call of the modules (`node`)."""

    ops: ctypes.Array | None = None
    kinds: list[str] = field(default_factory=list)
    node: _Node | None = None


class Program:
    """A step kind's program: its segments, its register count, the register of its output, the KDA modules whose
    prefix-cache snapshots the native ops leave to be copied, and what it keeps alive."""

    def __init__(self, segments: list[_Segment], registers: int, output: int, kda_modules: list, keep: list):
        self.segments, self.registers, self.output = segments, registers, output
        self.kda_modules, self.keep = kda_modules, keep

    @property
    def native_ops(self) -> int:
        return sum(len(s.kinds) for s in self.segments)

    def run(self, h: torch.Tensor, batch: StepBatch, step: StackStep) -> torch.Tensor:
        N, d = h.shape
        regs = torch.empty(self.registers, N, d, dtype=h.dtype)
        regs[0].copy_(h)
        eager = Eager(batch)
        lib = native.native_library()
        for seg in self.segments:
            if seg.node is None:
                failed = lib.ds_run_program(seg.ops, len(seg.kinds), N, d, regs.data_ptr(), step,
                                             torch.get_num_threads())
                if failed:
                    kind = seg.kinds[failed - 1]
                    raise _ERRORS.get(kind, RuntimeError)(
                        f"native program: a {kind} op rejected its inputs (a cache row outside the pages, or a router "
                        "shape the MoE block does not take)")
            else:
                regs[seg.node.out_reg].copy_(_run_modules(seg.node, regs, eager))
        if any(not isinstance(target, DraftSlot) for snaps in batch.kda_snapshots for _, target in snaps):
            for attn in self.kda_modules:  # prefix-cache checkpoints at sequence ends (the blocks wrote the drafts)
                attn.save_end_snapshots(batch, kda_pools(attn, batch.cache), range(batch.num_seqs))
        return regs[self.output]


def _run_modules(node: _Node, regs: torch.Tensor, eager: Eager) -> torch.Tensor:
    values = [regs[r] for r in node.in_regs]
    if node.kind == "reduce":
        total = node.layer.shard.all_reduce(values[0])
        return values[1] + total if node.residual else total
    if node.kind == "mix-modules":
        return eager.mix(node.query, values)
    residual = values[1] if node.residual else None
    if node.kind == "attention-modules":
        return eager.attention(node.layer, values[0], residual)
    return eager.ffn(node.layer, values[0], residual)


def write_program(model: torch.nn.Module, kind: StepKind, plans: LayerPlans, cache) -> Program | None:
    """The program of `kind` over `cache` for the current weights, or None when no sub-block of it is native."""
    writer = ProgramWriter(kind, plans, cache)
    output = model.run_layers(0, writer)
    nodes = writer.nodes
    if not any(n.op is not None for n in nodes):
        return None
    registers, assigned = _allocate(nodes, output)
    segments: list[_Segment] = []
    run: list[_Node] = []

    def close_run():
        if run:
            ops = (StackOp * len(run))(*(n.op for n in run))
            segments.append(_Segment(ops=ops, kinds=[n.kind for n in run]))
            run.clear()
    for node in nodes:
        if node.op is None:
            close_run()
            segments.append(_Segment(node=node))
        else:
            run.append(node)
    close_run()
    return Program(segments, registers, assigned[output], writer.kda_modules, writer.keep)


def _allocate(nodes: list[_Node], output: int) -> tuple[int, dict[int, int]]:
    """Registers for the values: a value's register is free again after its last reader, and a node's output never
    shares a register with its inputs. Fills in the native ops' register fields; returns (registers, value ->
    register)."""
    last_use = {0: -1}
    for i, node in enumerate(nodes):
        for v in node.inputs:
            last_use[v] = i
    last_use[output] = len(nodes)
    assigned = {0: 0}
    free: list[int] = []
    registers = 1
    for i, node in enumerate(nodes):
        if free:
            reg = free.pop()
        else:
            reg, registers = registers, registers + 1
        assigned[node.out] = reg
        for v in set(node.inputs):
            if last_use[v] == i:
                free.append(assigned[v])
        if last_use.get(node.out, i) <= i and node.out != output:  # written, never read
            free.append(reg)
        node_regs = node.in_regs = [assigned[v] for v in node.inputs]
        node.out_reg = reg
        if node.op is not None:
            if node.kind == "mix":
                node.op.out = reg
                node.op.sources[:len(node_regs)] = node_regs
            else:
                node.op.x, node.op.out = node_regs[0], reg
                node.op.residual = node_regs[1] if node.residual else -1
    return registers, assigned


class SingleLayer:
    """One ordinary residual decoder layer outside the stack (an MTP layer's block) as the stack a program is written
    from: what `Programs.run` reads of a model (`layers`, `modules`, `run_layers`)."""

    def __init__(self, layer: DecoderLayer):
        self.layers = [layer]

    def modules(self):
        return self.layers[0].modules()

    def run_layers(self, h, blocks):
        return self.layers[0].apply(h, blocks)


class Programs:
    """A model's programs, one per step kind, written at first use and rewritten when the cache object or a weight
    a program reads changes."""

    def __init__(self):
        self.plans = LayerPlans()
        self._sources: list[torch.Tensor] | None = None
        self._rotary = None
        self._cache = None
        self._by_kind: dict[StepKind, Derived] = {}

    def run(self, model: torch.nn.Module, h: torch.Tensor, batch: StepBatch) -> torch.Tensor | None:
        """The stack's final hidden state for the embedded input `h` [N, d], or None when no program runs this step
        (the caller then runs the modules)."""
        kind = StepKind.of(batch, h.shape[0])
        if kind is None or h.dtype != torch.bfloat16 or not h.is_contiguous():
            return None
        if batch.cache is not self._cache:
            self._cache, self._by_kind = batch.cache, {}
        if self._sources is None:
            self._sources = self.plans.sources(model)
            # every DSA layer's rotation is built from the same config keys, so the first serves them all
            self._rotary = next((layer.self_attn.rotary for layer in model.layers
                                 if getattr(layer.self_attn, "indexer", None) is not None), None)
        program = self._by_kind.setdefault(kind, Derived()).get(
            self._sources, lambda: write_program(model, kind, self.plans, batch.cache))
        if program is None:
            return None
        step, keep = _step_inputs(batch, kind, self._rotary)
        return program.run(h, batch, step)


def _step_inputs(batch: StepBatch, kind: StepKind, rotary) -> tuple[StackStep, list]:
    """The step's own inputs (`StackStep`) and the tensors they point into; `rotary` is the DSA layers' rotation
    (DeepSeek-V3.2; None for NoPE)."""
    slots = cu = rows = write = cos_sin = drafts = None
    nseq = batch.num_seqs
    if kind.kda:
        nseq, cu, slots = batch.kda_sequences
        drafts = batch.kda_draft_rows
    if kind.decode:
        rows = batch.context_rows
        write = batch.write_rows.to(torch.int64).contiguous()
        if rotary is not None:
            cos_sin = torch.stack(rotary.cos_sin(batch.positions)).float().contiguous()
    keep = [t for t in (slots, cu, rows, write, cos_sin, drafts) if t is not None]
    step = StackStep(slots=address(slots), nseq=nseq, cu=address(cu), rows=address(rows),
                     width=0 if rows is None else rows.shape[1], write_rows=address(write), cos_sin=address(cos_sin),
                     draft_rows=address(drafts))
    return step, keep
