"""Kimi Delta Attention layer (docs/model.md §8): projections, short convs, forget gate, beta, L2 norm, the delta-rule
recurrence (chunked for prefill chunks, recurrent for decode) and the gated output norm.

Per-sequence state (through `batch.cache`): conv windows [3, P, W-1] (q, k, v pre-conv inputs) and the recurrent
state [H, K, V] (key-major), both fp32.
"""

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed import Shard
from ..ops.kda import l2_normalize
from .batch import DraftSlot, StepBatch
from .derived import Derived
from .linear import Linear
from .norm import gated_rms_norm


class KimiDeltaAttention(nn.Module):
    """Over a tensor-parallel group each rank runs its share of the heads (`shard`); its o_proj output is a partial
    sum the decoder layer all-reduces."""

    def __init__(self, config: ModelConfig, layer: int, shard: Shard = Shard()):
        super().__init__()
        self.config, self.layer = config, layer
        d, H, K = config.hidden_size, shard.part(config.kda_num_heads), config.kda_head_dim
        P, W = H * K, config.kda_conv_size
        self.H, self.K, self.P, self.W = H, K, P, W
        self.q_proj, self.k_proj, self.v_proj = Linear(d, P), Linear(d, P), Linear(d, P)
        self.q_conv1d = _Conv(P, W)
        self.k_conv1d = _Conv(P, W)
        self.v_conv1d = _Conv(P, W)
        self.f_a_proj = Linear(d, K)
        self.f_b_proj = Linear(K, P)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(P, dtype=torch.float32))
        self.b_proj = Linear(d, H)
        if config.kda_full_rank_gate:
            self.g_proj = Linear(d, P)
        else:
            self.g_a_proj = Linear(d, K)
            self.g_b_proj = Linear(K, P)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K))
        self.o_proj = Linear(P, d)
        self._stacked_conv = Derived()

    def input_linears(self) -> list[nn.Module]:
        """The projections of the layer input, in the order their weights are stacked: q, k, v, f_a, b, g (or g_a)."""
        return [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj,
                self.g_proj if self.config.kda_full_rank_gate else self.g_a_proj]

    def input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """qkv [N, 3P] (the conv inputs q | k | v side by side), f_a, b and g (or g_a) of x."""
        q_in, k_in, v_in, *rest = [m(x) for m in self.input_linears()]
        return torch.cat([q_in, k_in, v_in], dim=-1), *rest

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        N = x.shape[0]
        qkv, f_a, b, g_in = self.input_projections(x)
        g, beta = batch.ops.kda_gate_beta(self.f_b_proj(f_a), b, self.dt_bias, self.A_log,
                                          self.config.kda_gate_lower_bound)
        gate = g_in if self.config.kda_full_rank_gate else self.g_b_proj(g_in)
        core = self.core(qkv, g, beta, batch)
        return self.o_proj(self.output_norm(core, gate).reshape(N, self.P))

    def output_norm(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The gated output norm of the core output [N, H, K] fp32 by the gate [N, P], in the gate's dtype."""
        N = core.shape[0]
        return gated_rms_norm(core.to(gate.dtype), gate.view(N, self.H, self.K), self.o_norm.weight,
                              self.config.rms_norm_eps)

    def core(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Short convs and the delta rule over the step's rows, [N, H, K] fp32. Over a cache with state slots,
        single-token rows run as one batched decode op and chunks as varlen rounds, states updated in their slots;
        without slots (no cache, or a per-sequence cache) each sequence runs on its own."""
        N, H, K = qkv.shape[0], self.H, self.K
        pool = batch.cache.kda_slot_pool(self.layer) if batch.cache is not None else None
        if pool is None:
            return self._per_sequence(qkv, g, beta, batch)
        core = torch.empty(N, H, K, dtype=torch.float32, device=qkv.device)
        decode = [i for i in range(batch.num_seqs) if batch.rows(i).stop - batch.rows(i).start == 1]
        if decode:  # a single-token row's snapshots (if any) fall after its token: taken once the slot is updated
            starts = [batch.rows(i).start for i in decode]
            slots = torch.tensor([batch.handle(i).slot for i in decode], device=qkv.device)
            if starts == list(range(N)):  # a pure decode step: every row, in order
                core = self._decode_batched(qkv, g, beta, pool, slots, batch.ops)
            else:
                rows = torch.tensor(starts, device=qkv.device)
                core[rows] = self._decode_batched(qkv[rows], g[rows], beta[rows], pool, slots, batch.ops)
            self.save_end_snapshots(batch, pool, decode)
        prefill = [i for i in range(batch.num_seqs) if i not in decode]
        if prefill:  # chunks of several sequences: varlen chunked ops over their slots
            core = self._prefill_varlen(qkv, g, beta, core, prefill, pool, batch)
        return core

    def save_end_snapshots(self, batch: StepBatch, pool: tuple[torch.Tensor, torch.Tensor], seqs) -> None:
        """Copy the slot state of each sequence in `seqs` into the prefix-cache checkpoints its snapshots name; every
        such snapshot of these sequences falls at the end of their rows, so the state after the step is the one to
        keep. Draft states (`DraftSlot`, after a row inside a verify chunk) are written by whatever ran the rows."""
        for i in seqs:
            slot = batch.handle(i).slot
            for _, checkpoint in batch.snapshots(i):
                if not isinstance(checkpoint, DraftSlot):
                    batch.cache.save_kda_checkpoint(self.layer, checkpoint, pool[0][slot], pool[1][slot])

    def _per_sequence(self, qkv, g, beta, batch: StepBatch) -> torch.Tensor:
        """Each sequence on its own state (read and overwritten in place), cut at its prefix-cache snapshots."""
        core = torch.empty(qkv.shape[0], self.H, self.K, dtype=torch.float32, device=qkv.device)
        for i in range(batch.num_seqs):
            rows = batch.rows(i)
            state = batch.cache.kda_state(self.layer, batch.handle(i)) if batch.cache is not None else None
            start = rows.start
            for end_offset, checkpoint in batch.snapshots(i) + [(rows.stop - rows.start, None)]:
                seg = slice(start, rows.start + end_offset)
                if seg.stop > seg.start:
                    core[seg] = self._segment(qkv[seg], g[seg], beta[seg], state, batch.ops)
                if checkpoint is not None:
                    batch.cache.save_kda_checkpoint(self.layer, checkpoint, *state)
                start = seg.stop
        return core

    def _conv_weight(self) -> torch.Tensor:
        """The q, k, v conv weights stacked [3P, W], kept until one of them changes."""
        convs = [c.weight for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        return self._stacked_conv.get(convs, lambda: torch.cat([w.detach().view(self.P, self.W) for w in convs]))

    def _decode_batched(self, qkv, g, beta, pool, slots, ops) -> torch.Tensor:
        """One token for each of n sequences: convs and the delta rule over their slots, in place."""
        conv_pool, rec_pool = pool
        window = conv_pool.view(conv_pool.shape[0], 3 * self.P, self.W - 1)  # a view: updates land in the pool
        return ops.kda_decode_step(qkv, self._conv_weight(), window, g, beta, self.K ** -0.5, rec_pool, slots)

    def _prefill_varlen(self, qkv, g, beta, core, seqs, pool, batch) -> torch.Tensor:
        """Chunks of several sequences, states read and written in their slots. A chunk is cut at its prefix-cache
        snapshot offsets; round r runs the r-th piece of every sequence in one varlen call (convs from each slot's
        window), and a piece ending at a snapshot copies the slot's state into the checkpoint. Returns `core` with
        the chunks' rows filled in, or the call's own output when one round covers every row (a prefill step with
        no snapshot: no copy of [N, H, K] fp32)."""
        conv_pool, rec_pool = pool
        window = conv_pool.view(conv_pool.shape[0], 3 * self.P, self.W - 1)
        weight = self._conv_weight()
        pieces = {}
        for i in seqs:
            rows, start, cuts = batch.rows(i), batch.rows(i).start, []
            for end_offset, checkpoint in batch.snapshots(i) + [(rows.stop - rows.start, None)]:
                cuts.append((start, rows.start + end_offset, checkpoint))
                start = rows.start + end_offset
            pieces[i] = cuts
        rounds = max(len(c) for c in pieces.values())
        for r in range(rounds):
            active = [(i, pieces[i][r]) for i in seqs if r < len(pieces[i])]
            run = [(i, a, b) for i, (a, b, _) in active if b > a]
            if run:
                adjacent = all(run[j][1] == run[j - 1][2] for j in range(1, len(run)))
                # adjacent pieces (one sequence's chunk, say) are one slice of the rows: views, no gathered copies
                rows = slice(run[0][1], run[-1][2]) if adjacent else torch.cat([torch.arange(a, b) for _, a, b in run])
                cu = torch.tensor([0] + [b - a for _, a, b in run]).cumsum(0)
                slots = torch.tensor([batch.handle(i).slot for i, _, _ in run])
                out = batch.ops.kda_step_varlen(qkv[rows], weight, window, g[rows], beta[rows], self.K ** -0.5, cu,
                                                rec_pool, slots)
                if (rounds == 1 and rows == slice(0, core.shape[0]) and out.shape == core.shape
                        and out.dtype == core.dtype and out.is_contiguous()):
                    core = out
                else:
                    core[rows] = out
            for i, (_, _, checkpoint) in active:
                if checkpoint is not None:
                    slot = batch.handle(i).slot
                    batch.cache.save_kda_checkpoint(self.layer, checkpoint, conv_pool[slot], rec_pool[slot])
        return core

    def _segment(self, qkv, g, beta, state, ops) -> torch.Tensor:
        """Short convs and the delta rule over consecutive tokens of one sequence; `state` (conv window,
        recurrent state) is read and overwritten in place when given."""
        H, K = self.H, self.K
        T = qkv.shape[0]
        convs = []
        inputs = qkv.split(self.P, dim=-1)
        for j, (inp, conv) in enumerate(zip(inputs, (self.q_conv1d, self.k_conv1d, self.v_conv1d))):
            y, new_window = ops.short_conv(inp, conv.weight.view(self.P, self.W),
                                           None if state is None else state[0][j])
            convs.append(y)
            if state is not None:
                state[0][j].copy_(new_window)
        q = l2_normalize(convs[0].float().view(T, H, K))
        k = l2_normalize(convs[1].float().view(T, H, K))
        v = convs[2].float().view(T, H, K)
        run = ops.kda_recurrent if T == 1 else ops.kda_chunk
        o, final = run(q, k, v, g, beta, K ** -0.5, None if state is None else state[1])
        if state is not None:
            state[1].copy_(final)
        return o


class _Conv(nn.Module):
    """Holds a depthwise conv weight under the checkpoint's name `*_conv1d.weight` [P, 1, W] (fp32)."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, width, dtype=torch.float32))
