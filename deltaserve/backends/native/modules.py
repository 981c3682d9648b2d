"""The native forms of the leaf modules: the same math as layers/, run on the native kernels (ops/native.py) where
the inputs take them (bf16 rows on the CPU), else by the module's own torch forward.

`NativeBackend.prepare` gives these classes to the modules whose weights the kernels take (bf16, CPU; MX weights
the kernels decode exactly, in a bf16 model). Each native product equals its torch twin to fp32 rounding of the sums
(tests/test_native.py holds them together). Linears take the 4-row dot tiles up to `LINEAR_MAX_ROWS` rows and the
column-packed product above; dense MLPs the fused expert kernel with one expert of weight 1 (on their linears' row
packs up to `MLP_MAX_ROWS` rows, column packs above, so one copy of each pack serves every size); routed experts the
fused expert kernel at every size (one call over all experts beats a per-expert dispatch from one token to a long
prefill chunk), with the shared MLP's products in the same pass.

MX linears and experts (layers/quantized.py) keep their weights only in the column products' order, as stored
(MXFP8 or MXFP4 codes and E8M0 scales, ops/native.py `mx_columns`): the kernels decode them a chunk at a time, so
no bf16 copy of a matrix exists; their stored form is rebuilt (`stored`) only for a non-bf16 input.
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
from ...layers.quantized import MXExperts, MXLinear
from ...ops.native import (ACT_OF, ColumnMatrix, gated_rmsnorm_bf16, linear_heads, linear_heads_columns, linear_mx,
                           moe_bf16, moe_mx, mx_columns, mx_exact, mx_stored, native_library, pack_columns, pack_rows,
                           rmsnorm_bf16, router_bf16)
from ...ops.mx import dequantize_mx
from ...ops.native_contract import LINEAR_MAX_ROWS, MAT_BF16, MLP_MAX_ROWS
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


def _keep_columns(module: torch.nn.Module, names: list[str], matrices: list[ColumnMatrix]) -> None:
    """Replace an MX module's stored-layout buffers by the column-ordered ones (one copy of the weights, counted by
    the module's buffers as before): `<name>_columns` and `<name>_column_scales`."""
    for buffer in list(module._buffers):
        del module._buffers[buffer]
    module.column_layout = {}
    for name, m in zip(names, matrices):
        module.register_buffer(f"{name}_columns", m.data)
        module.register_buffer(f"{name}_column_scales", m.scales)
        module.column_layout[name] = (m.format, m.shape)


def _columns(module: torch.nn.Module, name: str, act) -> ColumnMatrix:
    fmt, shape = module.column_layout[name]
    return ColumnMatrix(getattr(module, f"{name}_columns"), getattr(module, f"{name}_column_scales"), fmt, shape,
                        ACT_OF[act])


class NativeMXLinear(MXLinear):
    """An MX linear on `linear_mx`: its weight read as stored, in the column products' order."""

    def attach(self) -> None:
        _keep_columns(self, ["weight"], [mx_columns(*MXLinear.stored(self), self.scheme.weight)])
        self._dense = None

    def columns(self) -> ColumnMatrix:
        """The weight as the kernels read it, its products quantising inputs as the scheme says."""
        return _columns(self, "weight", self.scheme.act_mode if self.scheme.act is not None else None)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        return mx_stored(self.columns())

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_mx(*self.stored(), self.scheme.weight, dtype)  # not kept: only non-bf16 inputs need it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.dtype == torch.bfloat16 and x.shape[-1] == self.in_features):
            return super().forward(x)
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return linear_mx(rows, self.columns()).reshape(*x.shape[:-1], self.out_features)


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


class NativeMXExperts(MXExperts):
    """MXFP4 routed experts on `moe_mx`: every token through the fused expert kernel over the stacks as stored, in
    the column products' order."""

    def attach(self) -> None:
        names = ["w1", "w3", "w2"]
        _keep_columns(self, names, [mx_columns(*MXExperts.stored(self, w), self.scheme.weight) for w in names])

    def column_matrices(self) -> tuple[ColumnMatrix, ColumnMatrix, ColumnMatrix]:
        act = self.scheme.act_mode if self.scheme.act is not None else None
        return tuple(_columns(self, w, act) for w in ("w1", "w3", "w2"))

    def stored(self, w: str) -> tuple[torch.Tensor, torch.Tensor]:
        return mx_stored(_columns(self, w, None))

    @property
    def num_experts(self) -> int:
        return self.column_layout["w1"][1][0]

    def forward(self, x: torch.Tensor, routing: Routing,
                shared: tuple[ColumnMatrix, ColumnMatrix, ColumnMatrix] | None = None) -> torch.Tensor:
        """The routed experts' output; with `shared` (`NativeMLP.column_matrices`) plus that MLP's, in one pass."""
        if x.dtype != torch.bfloat16:
            if shared is not None:
                raise ValueError("NativeMXExperts: a shared MLP runs in the expert pass only on bf16 rows")
            return super().forward(x, routing)
        return moe_mx(x.contiguous(), routing.experts, routing.weights, *self.column_matrices(),
                      situ=situ_params(self.config), shared=shared)


def _native_linears(*modules: torch.nn.Module) -> bool:
    return all(type(m) is NativeLinear for m in modules)


def _column_matrix(linear: torch.nn.Module) -> ColumnMatrix | None:
    """A native linear's weight as the expert kernel reads it (bf16 column pack or MX columns); None otherwise."""
    if type(linear) is NativeLinear:
        pack = linear.column_pack()
        return ColumnMatrix(pack, None, MAT_BF16, tuple(linear.weight.shape))
    if type(linear) is NativeMXLinear:
        return linear.columns()
    return None


class NativeMLP(MLP):
    def attach(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linears = (self.gate_proj, self.up_proj, self.down_proj)
        if not takes_native(x, None):
            return super().forward(x)
        if not _native_linears(*linears):
            mx = self.column_matrices()
            if mx is None:
                return super().forward(x)
            # MX linears: the expert kernel with one expert of weight 1, each product quantising its own inputs
            T = x.shape[0]
            return moe_mx(x.contiguous(), torch.zeros(T, 1, dtype=torch.int64), torch.ones(T, 1),
                          *(m._replace(shape=(1, *m.shape)) for m in mx), situ=situ_params(self.config))
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

    def column_matrices(self) -> tuple[ColumnMatrix, ColumnMatrix, ColumnMatrix] | None:
        """The gate, up and down weights as the expert kernel reads them (bf16 column packs or MX columns, gate and
        up quantising their inputs alike), for `moe_mx`; None when a linear is neither."""
        mx = tuple(_column_matrix(m) for m in (self.gate_proj, self.up_proj, self.down_proj))
        if any(m is None for m in mx) or mx[0].act != mx[1].act:
            return None
        return mx


class NativeMoE(MoE):
    def attach(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts
        if (self.latent or self.expert_parallel or type(self.experts) not in (NativeExperts, NativeMXExperts)
                or type(shared) is not NativeMLP or x.dtype != torch.bfloat16):
            return super().forward(x)
        # the shared MLP's products overlap the routed experts' weight stream
        if type(self.experts) is NativeExperts:
            packs = shared.shared_packs()
            if packs is not None:
                return self.experts(x, self.gate(x), shared=packs)
            return super().forward(x)
        columns = shared.column_matrices()
        return self.experts(x, self.gate(x), shared=columns) if columns is not None else super().forward(x)


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
    MXLinear: NativeMXLinear, MXExperts: NativeMXExperts,
}


def kernels_take(module: torch.nn.Module, model_dtype: torch.dtype = torch.bfloat16) -> bool:
    """The kernels built and the module's weights are what they read: bf16 on the CPU (for MLA, a plain bf16
    kv_b_proj; for KDA, its output norm weight); MX weights on the CPU that the kernels decode exactly, in a model
    of `model_dtype` bf16 (their products take bf16 rows)."""
    if native_library() is None:
        return False
    if isinstance(module, MXLinear):
        data, scale = module.stored()
        return model_dtype == torch.bfloat16 and data.device.type == "cpu" and mx_exact(data, scale,
                                                                                          module.scheme.weight)
    if isinstance(module, MLP) and all(isinstance(m, MXLinear) for m in (module.gate_proj, module.up_proj)):
        return model_dtype == torch.bfloat16  # its linears are taken (or not) on their own
    if isinstance(module, MXExperts):
        stacks = [module.stored(w) for w in ("w1", "w3", "w2")]
        return model_dtype == torch.bfloat16 and all(d.device.type == "cpu" and mx_exact(d, s, module.scheme.weight)
                                                     for d, s in stacks)
    if isinstance(module, MLAttention):
        weight = module.kv_b_proj.weight if isinstance(module.kv_b_proj, Linear) else None
    elif isinstance(module, KimiDeltaAttention):
        weight = module.o_norm.weight
    else:  # a leaf's own weight; for MLP and MoE (containers) their first linear's or the router's
        weight = next(module.parameters(), None)
    return weight is not None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
