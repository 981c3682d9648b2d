"""The native forms of the leaf modules: the same math as layers/, run on the native kernels (ops/native.py) where
the inputs take them (bf16 rows on the CPU), else by the module's own torch forward.

`NativeBackend.prepare` gives these classes to the modules whose weights the kernels take (bf16, CPU); quantized
modules (layers/quantized.py) keep theirs. Each native product equals its torch twin to fp32 rounding of the sums
(tests/test_native.py holds them together). Linears take the 4-row dot tiles up to `LINEAR_MAX_ROWS` rows and the
column-packed product above; dense MLPs the fused expert kernel with one expert of weight 1 (on their linears' row
packs up to `MLP_MAX_ROWS` rows, column packs above, so one copy of each pack serves every size); routed experts the
fused expert kernel at every size (one call over all experts beats a per-expert dispatch from one token to a long
prefill chunk), with the shared MLP's products in the same pass.
"""

from __future__ import annotations

import torch

from ...layers.derived import Derived
from ...layers.kda import KimiDeltaAttention
from ...layers.linear import Linear
from ...layers.mla import MLAttention
from ...config import ModelConfig
from ...layers.mlp import MLP
from ...layers.moe import MoE, Experts, Router, Routing
from ...layers.norm import RMSNorm
from ...ops.native import (gated_rmsnorm_bf16, linear_heads, linear_heads_columns, moe_bf16, native_library,
                           pack_columns, pack_rows, rmsnorm_bf16, router_bf16)
from ...ops.native_contract import LINEAR_MAX_ROWS, MLP_MAX_ROWS
from ..packs import PackedWeights, native_product, takes_native


def situ_params(config: ModelConfig) -> tuple[float, float | None] | None:
    """(beta, linear_beta) when the activation is SiTU, else None (SiLU-GLU): what the expert kernel is told."""
    return (config.situ_beta, config.situ_linear_beta) if config.hidden_act == "situ" else None


class NativeLinear(Linear):
    def attach(self) -> None:
        self.packs = PackedWeights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = native_product(x, [self.weight], self.packs)
        return super().forward(x) if y is None else y

    def row_pack(self) -> torch.Tensor:
        return self.packs.rows([self.weight])

    def column_pack(self) -> torch.Tensor:
        """The column pack it multiplies with above LINEAR_MAX_ROWS rows (and the fused blocks with it)."""
        return self.packs.columns([self.weight])


class NativeRMSNorm(RMSNorm):
    def attach(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes_native(x, None):
            return rmsnorm_bf16(x, self.weight, self.eps)
        return super().forward(x)


class NativeRouter(Router):
    def attach(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> Routing:
        if not takes_native(x, None):
            return super().forward(x)
        c = self.config
        return Routing(*router_bf16(x, self.weight_f32(), self.bias_f32(), c.num_experts_per_token,
                                    c.router_activation != "sigmoid", c.num_expert_group, c.topk_group,
                                    c.moe_renormalize, c.routed_scaling_factor))


class NativeExperts(Experts):
    """Every token through the fused expert kernel, on the experts' column packs (built at load: an expert is first
    used whenever it is first routed to, so packing then would stall a step)."""

    def attach(self) -> None:
        self._packs = Derived()
        self.column_packs()

    def column_packs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w1, w3, w2 in the expert kernel's column-packed layout, rebuilt when a weight changes."""
        weights = [self.w1, self.w3, self.w2]
        return self._packs.get(weights, lambda: tuple(pack_columns(w) for w in weights))

    def forward(self, x: torch.Tensor, routing: Routing,
                shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
        """The routed experts' output; with `shared` (`NativeMLP.shared_packs`) plus that MLP's, computed in the
        same kernel pass and added as `MoE` adds them."""
        if x.dtype != torch.bfloat16:
            if shared is not None:
                raise ValueError("NativeExperts: a shared MLP runs in the expert pass only on bf16 rows")
            return super().forward(x, routing)
        return moe_bf16(x.contiguous(), routing.experts, routing.weights, self.w1, self.w3, self.w2,
                        packed=self.column_packs(), situ=situ_params(self.config), shared=shared)


def _native_linears(*modules: torch.nn.Module) -> bool:
    return all(type(m) is NativeLinear for m in modules)


class NativeMLP(MLP):
    def attach(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linears = (self.gate_proj, self.up_proj, self.down_proj)
        if not (_native_linears(*linears) and takes_native(x, None)):
            return super().forward(x)
        # the fused expert kernel with one expert of weight 1: the three products' roundings, with the activation
        # applied to the gate and up sums as they come instead of written out and read back
        T = x.shape[0]
        few = T <= MLP_MAX_ROWS
        packed = tuple((m.row_pack() if few else m.column_pack()).unsqueeze(0) for m in linears)
        return moe_bf16(x.contiguous(), torch.zeros(T, 1, dtype=torch.int64), torch.ones(T, 1),
                        *(m.weight.unsqueeze(0) for m in linears), packed=packed, situ=situ_params(self.config))

    def shared_packs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """The gate, up and down column packs and the width, for the routed experts' kernel to run this MLP as the
        MoE's shared expert in its own pass; None when a linear is not native (quantized)."""
        linears = (self.gate_proj, self.up_proj, self.down_proj)
        if not _native_linears(*linears):
            return None
        return (*(m.column_pack() for m in linears), self.gate_proj.out_features)


class NativeMoE(MoE):
    def attach(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts
        if (self.latent or type(self.experts) is not NativeExperts or type(shared) is not NativeMLP
                or x.dtype != torch.bfloat16):
            return super().forward(x)
        packs = shared.shared_packs()
        if packs is None:
            return super().forward(x)
        # the shared MLP's products overlap the routed experts' weight stream
        return self.experts(x, self.gate(x), shared=packs)


class NativeKimiDeltaAttention(KimiDeltaAttention):
    """The input projections as one native product over their stacked weights; the gated output norm in one pass."""

    def attach(self) -> None:
        self.input_packs = PackedWeights()

    def input_weights(self) -> list[torch.Tensor]:
        return [m.weight for m in self.input_linears()]

    def input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        linears = self.input_linears()
        y = native_product(x, self.input_weights(), self.input_packs) if _native_linears(*linears) else None
        if y is None:
            return super().input_projections(x)
        # qkv stays a column view: the conv kernels read rows at any stride
        rest = torch.split(y[:, 3 * self.P:], [m.weight.shape[0] for m in linears[3:]], dim=-1)
        return y[:, :3 * self.P], *(part.contiguous() for part in rest)

    def output_norm(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if gate.dtype != torch.bfloat16 or gate.stride(-1) != 1:
            return super().output_norm(core, gate)
        N = core.shape[0]
        gate_rows = gate.reshape(N * self.H, self.K)  # one row per head (a copy when the gate is a column slice)
        return gated_rmsnorm_bf16(core.view(N * self.H, self.K), gate_rows, self.o_norm.weight,
                                  self.config.rms_norm_eps)


class NativeMLAttention(MLAttention):
    """The per-head absorptions W_UK and W_UV in one native call over all heads (row packs up to LINEAR_MAX_ROWS
    rows, column packs above, as the linears)."""

    def attach(self) -> None:
        self._kv_b_packs = {False: Derived(), True: Derived()}

    def kv_b_packs(self, columns: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK^T [H, r, n] and W_UV [H, v, r] packed for the native kernels, row- or column-packed, each kept until
        kv_b_proj changes."""
        pack = pack_columns if columns else pack_rows

        def build():
            w = self._kv_b_heads()
            return pack(w[:, :self.n].transpose(1, 2)), pack(w[:, self.n:])
        return self._kv_b_packs[columns].get([self.kv_b_proj.weight], build)

    def _heads(self, x: torch.Tensor, which: int, n_out: int) -> torch.Tensor:
        if x.shape[0] <= LINEAR_MAX_ROWS:
            return linear_heads(x, self.kv_b_packs(columns=False)[which], n_out)
        return linear_heads_columns(x, self.kv_b_packs(columns=True)[which], n_out)

    def _absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        return self._heads(q_nope, 0, self.r) if q_nope.dtype == torch.bfloat16 else super()._absorb(q_nope)

    def _unabsorb(self, out_lat: torch.Tensor) -> torch.Tensor:
        return self._heads(out_lat, 1, self.v) if out_lat.dtype == torch.bfloat16 else super()._unabsorb(out_lat)


NATIVE_FORMS: dict[type, type] = {
    Linear: NativeLinear, RMSNorm: NativeRMSNorm, Router: NativeRouter, Experts: NativeExperts, MLP: NativeMLP,
    MoE: NativeMoE, KimiDeltaAttention: NativeKimiDeltaAttention, MLAttention: NativeMLAttention,
}


def kernels_take(module: torch.nn.Module) -> bool:
    """The kernels built and the module's weights are what they read: bf16 on the CPU (for MLA, a plain bf16
    kv_b_proj; for KDA, its output norm weight)."""
    if native_library() is None:
        return False
    if isinstance(module, MLAttention):
        weight = module.kv_b_proj.weight if isinstance(module.kv_b_proj, Linear) else None
    elif isinstance(module, KimiDeltaAttention):
        weight = module.o_norm.weight
    else:  # a leaf's own weight; for MLP and MoE (containers) their first linear's or the router's
        weight = next(module.parameters(), None)
    return weight is not None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
