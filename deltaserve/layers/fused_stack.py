"""A decode step of the whole decoder stack as one native call (native_src/stack.c).

With every layer's sub-blocks fused (layers/fused_blocks.py), a batch-1 step still spends a sizeable share of
its time in Python between its native calls (argument checks, descriptor keys, ctypes, output tensors): 33 calls
on kimi-linear-small, 64 blocks and 32 AttnRes mixes on k31-small. `DecodeStack` writes the
layers' blocks and mixes, in the order the layers' forward makes them, as one program over a register file of
[N, d] row sets; a step checks its inputs once and makes one call. The calls and their inputs are the per-layer
path's, so the hidden states, states and cache rows are the same bit for bit (tests/test_fused_stack.py).

The stack applies when every layer's blocks would apply on this step (the same conditions as the per-layer path:
every block kind fusable, every native switch and `fuse_blocks` on, a pure decode step of at most the blocks' row
count, plain bf16/fp32 pages, AttnRes mixes on the native kernel);
otherwise the layers run one by one. Prefix-cache snapshots of the step (a sequence ending a page) are copied
from the KDA slots after the call, as the blocks do. The program holds cache addresses and the descriptors'
addresses, so it is rebuilt when the cache object or any weight it reads (storage or version counter) changes.
"""

from __future__ import annotations

from operator import attrgetter

import torch

from ..ops import native
from ..ops.attn_res import attn_res_mix
from ..ops.native_contract import (MAX_MIX_SOURCES, SOP_DSA, SOP_FFN, SOP_KDA, SOP_MIX, SOP_MLA, StackOp,
                                   StackStep)
from .batch import StepBatch
from .fused_attention import dsa_pages, kda_pools, mla_pages, rotation, save_step_checkpoints, step_rows
from .fused_plan import Plan, address, takes_block
from .prepack import Derived

_OPS = {"kda": SOP_KDA, "mla": SOP_MLA, "dsa": SOP_DSA, "ffn": SOP_FFN}
_ERRORS = {"mla": IndexError, "dsa": IndexError, "ffn": ValueError}
_FUSE_BLOCKS, _NATIVE = attrgetter("fuse_blocks"), attrgetter("native")  # read every step, so kept cheap


class _Program:
    """The op records (ops/native_contract.py `StackOp`), the kind of each op, the register count and the register
    holding the output."""

    def __init__(self, ops: list[StackOp], kinds: list[str], registers: int, output: int, keep: list):
        self.ops = (StackOp * len(ops))(*ops)
        self.kinds, self.registers, self.output, self.keep = kinds, registers, output, keep


class _Writer:
    """Writes op records and hands out registers; register 0 holds the embedded input."""

    def __init__(self):
        self.ops: list[StackOp] = []
        self.kinds: list[str] = []
        self.registers, self._free = 1, []

    def fresh(self) -> int:
        if self._free:
            return self._free.pop()
        self.registers += 1
        return self.registers - 1

    def release(self, reg: int) -> None:
        self._free.append(reg)

    def op(self, kind: str, op: StackOp) -> None:
        self.ops.append(op)
        self.kinds.append(kind)

    def block(self, block: tuple[str, dict], x: int, residual: int | None, out: int) -> None:
        """One fused block: its kind and its fixed fields (descriptor and cache addresses), over registers."""
        kind, fixed = block
        self.op(kind, StackOp(kind=_OPS[kind], x=x, residual=-1 if residual is None else residual, out=out, **fixed))

    def mix(self, query, sources: list[int]) -> int:
        """The register of AttnRes's mix of `sources` (the source itself when there is one, as attn_res_mix)."""
        if len(sources) == 1:
            return sources[0]
        out = self.fresh()
        op = StackOp(kind=SOP_MIX, out=out, query=query.proj.weight[0].data_ptr(), norm_w=query.norm.weight.data_ptr(),
                     eps=query.eps, nsources=len(sources))
        held = sources[:MAX_MIX_SOURCES]  # a mix of more is left to the C side to reject: the step fails at this op
        op.sources[:len(held)] = held
        self.op("mix", op)
        return out


def _cache_fields(plan: Plan, cache) -> dict | None:
    """The op's cache fields (`StackOp`), or None when the cache is not in a layout the block reads."""
    if plan.kind == "kda":
        pools = kda_pools(plan.module, cache)
        return None if pools is None else dict(conv=pools[0].data_ptr(), conv_stride=pools[0].stride(0),
                                               rec=pools[1].data_ptr(), rec_stride=pools[1].stride(0))
    if plan.kind == "mla":
        latent = mla_pages(plan.module, cache)
        return None if latent is None else _page_fields(latent)
    if plan.kind == "dsa":
        pages = dsa_pages(plan.module, cache)
        return None if pages is None else dict(**_page_fields(pages[0]), keys=pages[1].data_ptr(),
                                               ldk=pages[1].stride(0), keys_bf16=int(pages[1].dtype == torch.bfloat16))
    return {}


def _page_fields(t: torch.Tensor) -> dict:
    return dict(pages=t.data_ptr(), ld=t.stride(0), nrows=t.shape[0], pages_bf16=int(t.dtype == torch.bfloat16))


def _mix_on_native(query) -> bool:
    """The query's weights are what `attn_res_mix` takes to its native kernel (bf16, contiguous, [d])."""
    q, w = query.proj.weight[0], query.norm.weight
    return q.dtype == w.dtype == torch.bfloat16 and q.is_contiguous() and w.is_contiguous() and q.shape == w.shape


class DecodeStack:
    """The decode program of one CausalLM, gathered at first use and rebuilt when its cache or weights change."""

    def __init__(self):
        self._plans: list[tuple[Plan, Plan]] | None = None
        self._gathered = False
        self._cache = None
        self._program = Derived()

    def run(self, model: torch.nn.Module, h: torch.Tensor, batch: StepBatch) -> torch.Tensor | None:
        """The decoder stack's final hidden state for the embedded input `h` [N, d], or None when some layer's
        blocks would not apply to this step (the caller then runs the layers)."""
        plans = self._layer_plans(model)
        if plans is None or not takes_block(h, None, self._max_rows) or batch.cache is None:
            return None
        if not all(map(_FUSE_BLOCKS, model.layers)) or not all(map(_NATIVE, self._switches)):
            return None
        if model.config.attn_res_block_size is not None and batch.ops.attn_res_mix is not attn_res_mix:
            return None
        step = self._step_inputs(batch, h.shape[0])
        if step is None:
            return None
        if batch.cache is not self._cache:
            self._cache, self._program = batch.cache, Derived()
        program = self._program.get(self._sources, lambda: self._write(model, batch.cache))
        if program is None:
            return None
        N, d = h.shape
        regs = torch.empty(program.registers, N, d, dtype=h.dtype)
        regs[0].copy_(h)
        failed = native.native_library().ds_decode_stack(program.ops, len(program.kinds), N, d, regs.data_ptr(),
                                                         step[0], torch.get_num_threads())
        if failed:
            kind = program.kinds[failed - 1]
            raise _ERRORS.get(kind, RuntimeError)(
                f"decode stack: op {failed - 1} ({kind}) rejected its inputs (a cache row outside the pages, or a "
                "router shape the MoE block does not take)")
        if any(batch.kda_snapshots):
            for attn, _ in self._plans:
                if attn.kind == "kda":
                    save_step_checkpoints(attn.module, batch, *kda_pools(attn.module, batch.cache))
        return regs[program.output]

    def _layer_plans(self, model: torch.nn.Module) -> list[tuple[Plan, Plan]] | None:
        """Every layer's (attention, FFN) plans, or None when some layer has a block that never applies."""
        if not self._gathered:
            self._gathered = True
            plans = [(layer.block_plans.attention(layer), layer.block_plans.ffn(layer)) for layer in model.layers]
            queries = [q for layer in model.layers if layer.attn_res
                       for q in (layer.self_attention_res, layer.mlp_res)]
            if model.config.attn_res_block_size is not None:
                queries.append(model.output_attn_res)
            if all(a is not None and f is not None for a, f in plans) and all(map(_mix_on_native, queries)):
                self._plans = plans
                self._max_rows = min(p.max_rows for pair in plans for p in pair)
                self._switches = list({id(m): m for pair in plans for p in pair for m in p.switches}.values())
                self._kinds = {p.kind for pair in plans for p in pair}
                self._sources = [w for pair in plans for p in pair for w in p.sources]
                self._sources += [w for q in queries for w in (q.proj.weight, q.norm.weight)]
        return self._plans

    def _step_inputs(self, batch: StepBatch, N: int) -> tuple[StackStep, list] | None:
        """The step's inputs (`StackStep`) and the tensors they point into, or None when this is not a pure decode
        step every block takes."""
        slots = rows = write = cos_sin = None
        if "kda" in self._kinds:
            slots = batch.decode_slots
            if slots is None or slots.numel() != N:
                return None
        if self._kinds & {"mla", "dsa"}:
            both = step_rows(batch)
            if both is None:
                return None
            rows, write = both
        if "dsa" in self._kinds:
            # every DSA layer's rotation is built from the same config keys, so one serves them all
            cos_sin = rotation(next(a.module for a, _ in self._plans if a.kind == "dsa"), batch)
        keep = [t for t in (slots, rows, write, cos_sin) if t is not None]
        step = StackStep(slots=address(slots), rows=address(rows), width=0 if rows is None else rows.shape[1],
                         write_rows=address(write), cos_sin=address(cos_sin))
        return step, keep

    def _write(self, model: torch.nn.Module, cache) -> _Program | None:
        """The program of the current weights over `cache`, or None when some block does not apply to them."""
        blocks, keep = [], []
        for pair in self._plans:
            for plan in pair:
                desc, fields = plan.weights_descriptor(), _cache_fields(plan, cache)
                if desc is None or fields is None:
                    return None
                keep.append(desc)
                blocks.append((plan.kind, dict(descriptor=desc.address, **fields)))
        layers = list(zip(blocks[::2], blocks[1::2]))  # (attention, FFN) of each layer
        w = _Writer()
        if model.config.attn_res_block_size is None:
            h = 0
            for attn, ffn in layers:
                a = w.fresh()
                w.block(attn, h, h, a)
                w.release(h)
                h = w.fresh()
                w.block(ffn, a, a, h)
                w.release(a)
            return _Program(w.ops, w.kinds, w.registers, h, keep)
        bank: list[int] = []
        p = 0
        for layer, (attn, ffn) in zip(model.layers, layers):
            # the registers of DecoderLayer.forward_attn_res: x, the bank of block sums, the partial sum p, y
            x = w.mix(layer.self_attention_res, bank + [p]) if bank else p
            write = model.config.attnres_write(layer.layer)
            if write:
                bank.append(p)
            a = w.fresh()
            w.block(attn, x, None if write else p, a)
            if x != p:
                w.release(x)
            if not write:
                w.release(p)
            p = a
            y = w.mix(layer.mlp_res, bank + [p])
            out = w.fresh()
            w.block(ffn, y, p, out)
            if y != p:
                w.release(y)
            w.release(p)
            p = out
        output = w.mix(model.output_attn_res, bank + [p])
        return _Program(w.ops, w.kinds, w.registers, output, keep)
