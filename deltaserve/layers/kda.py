"""Kimi Delta Attention layer (docs/model.md §8): projections, short convs, forget gate, beta, L2 norm, the delta-rule
recurrence (chunked for prefill chunks, recurrent for decode) and the gated output norm.

Per-sequence state (through `batch.cache`): conv windows [3, P, W-1] (q, k, v pre-conv inputs) and the recurrent
state [H, K, V] (key-major), both fp32.
"""

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.kda import l2_normalize
from ..ops.native import gated_rmsnorm_bf16
from .batch import StepBatch
from .linear import Linear
from .prepack import Derived, PackedWeights, stacked_product
from .norm import gated_rms_norm


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.config, self.layer = config, layer
        d, H, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim
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
        self._inputs = PackedWeights()
        self._stacked_conv = Derived()
        self.native = False  # the output norm through the native kernel (layers/native_path.py)

    def input_linears(self) -> list[nn.Module]:
        """The projections of the layer input, in the order their weights are stacked: q, k, v, f_a, b, g (or g_a)."""
        return [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj,
                self.g_proj if self.config.kda_full_rank_gate else self.g_a_proj]

    def _input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """qkv [N, 3P] (the conv inputs q | k | v side by side), f_a, b and g (or g_a) of x. With one product over
        the stacked weights, qkv is a column view of it (the conv kernels read rows at any stride: no copy)."""
        linears = self.input_linears()
        y = stacked_product(x, linears, self._inputs)
        if y is None:
            q_in, k_in, v_in, *rest = [m(x) for m in linears]
            return torch.cat([q_in, k_in, v_in], dim=-1), *rest
        rest = torch.split(y[:, 3 * self.P:], [m.weight.shape[0] for m in linears[3:]], dim=-1)
        return y[:, :3 * self.P], *(part.contiguous() for part in rest)

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        N, H, K = x.shape[0], self.H, self.K
        qkv, f_a, b, g_in = self._input_projections(x)
        gate_beta = batch.ops.kda_gate_beta
        g, beta = gate_beta(self.f_b_proj(f_a), b, self.dt_bias, self.A_log, self.config.kda_gate_lower_bound)
        gate = g_in if self.config.kda_full_rank_gate else self.g_b_proj(g_in)

        core = torch.empty(N, H, K, dtype=torch.float32, device=x.device)
        pool = batch.cache.kda_slot_pool(self.layer) if batch.cache is not None else None
        decode = [i for i in range(batch.num_seqs)
                  if pool is not None and batch.rows(i).stop - batch.rows(i).start == 1 and not batch.snapshots(i)]
        if decode:  # single-token rows of every sequence at once, states updated in place in their slots
            starts = [batch.rows(i).start for i in decode]
            slots = torch.tensor([batch.handle(i).slot for i in decode], device=x.device)
            if starts == list(range(N)):  # a pure decode step: every row, in order
                core = self._decode_batched(qkv, g, beta, pool, slots, batch.ops)
            else:
                rows = torch.tensor(starts, device=x.device)
                core[rows] = self._decode_batched(qkv[rows], g[rows], beta[rows], pool, slots, batch.ops)
        prefill = [i for i in range(batch.num_seqs) if pool is not None and i not in decode]
        if prefill:  # chunks of several sequences: varlen chunked ops over their slots
            core = self._prefill_varlen(qkv, g, beta, core, prefill, pool, batch)
        for i in sorted(set(range(batch.num_seqs)) - set(decode) - set(prefill)):
            rows = batch.rows(i)
            state = batch.cache.kda_state(self.layer, batch.handle(i)) if batch.cache is not None else None
            # A prefix-cache snapshot is taken exactly at each requested offset: split the chunk there.
            start = rows.start
            for end_offset, checkpoint in batch.snapshots(i) + [(rows.stop - rows.start, None)]:
                seg = slice(start, rows.start + end_offset)
                if seg.stop > seg.start:
                    core[seg] = self._segment(qkv[seg], g[seg], beta[seg], state, batch.ops)
                if checkpoint is not None:
                    batch.cache.save_kda_checkpoint(self.layer, checkpoint, *state)
                start = seg.stop
        if self.native and x.dtype == torch.bfloat16 and gate.stride(-1) == 1:
            gate_rows = gate.reshape(N * H, K)  # one row per head (a copy when the gate is a column slice)
            out = gated_rmsnorm_bf16(core.view(N * H, K), gate_rows, self.o_norm.weight, self.config.rms_norm_eps)
        else:
            out = gated_rms_norm(core.to(x.dtype), gate.view(N, H, K), self.o_norm.weight, self.config.rms_norm_eps)
        return self.o_proj(out.reshape(N, self.P))

    def packable_dtype(self) -> torch.dtype:
        return self.o_norm.weight.dtype

    def packable_device(self) -> torch.device:
        return self.o_norm.weight.device

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
