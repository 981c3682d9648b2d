"""MX-quantized layers and the quantization schemes that place them (docs/ops.md §7–8).

A scheme says how two kinds of weight are stored and run:
  * "dense": the attention linears (MLA q_a/q_b/kv_a/o/g projections, every KDA projection), the shared experts, dense
    MLPs and the latent-MoE down/up projections;
  * "experts": the stacked routed experts.
Left in the model dtype whatever the scheme: the router, norms, embeddings, lm_head (and the MTP heads and eh_proj),
AttnRes projections, the DSA indexer, and MLA's kv_b_proj (the layer reads its weight matrix for the absorbed
attention). A dense linear whose input width is not a multiple of 32 (e.g. a KDA f_b_proj over a small head dim)
cannot form MX blocks and also stays unquantised.

  w8a8-mxfp8  dense W8A8 MXFP8: E4M3 weights (FLOOR scales, OCP's conversion, done once at load) and E4M3
              activations quantised per 32 at run time with RCEIL scales, which never saturate a block's largest
              value (FLOOR clips it whenever it lies in (448, 512) times the scale), as GPU/NPU dynamic quantisers and
              W4A8 below do; on the trained default model it keeps 96.3% of bf16's argmaxes against 95.8% with FLOOR
              (BENCHMARKS.md)
  w4a8-mxfp4  experts W4A8: MXFP4 weights, MXFP8-E4M3 activations (RCEIL scales)
  mxfp        both, as the Ascend K3.1 deployment
Experts stored MXFP4 without activation quantisation (the released K3 checkpoint) run W4A16.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from ..ops.mx import BLOCK, E2M1, E4M3, ElementFormat, ScaleMode, dequantize_mx, quantize_mx
from ..ops.mx_linear import mx_linear
from .linear import Linear
from .mlp import glu_activation
from .moe import Experts, Routing, dispatch_experts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MXScheme:
    """How one kind of weight is stored and run: weight elements, activation elements (None = unquantised), and
    the activations' scale rule."""

    weight: ElementFormat
    act: ElementFormat | None
    act_mode: ScaleMode = ScaleMode.FLOOR

    @property
    def ct_format(self) -> str:
        """compressed-tensors format name of the weights."""
        return "mxfp4-pack-quantized" if self.weight is E2M1 else "mxfp8-quantized"


W8A8_MXFP8 = MXScheme(E4M3, E4M3, ScaleMode.RCEIL)
W8A16_MXFP8 = MXScheme(E4M3, None)
W4A8_MXFP4 = MXScheme(E2M1, E4M3, ScaleMode.RCEIL)
W4A16_MXFP4 = MXScheme(E2M1, None)


@dataclass(frozen=True)
class Quantization:
    dense: MXScheme | None = None
    experts: MXScheme | None = None


SCHEMES = {
    "w8a8-mxfp8": Quantization(dense=W8A8_MXFP8),
    "w4a8-mxfp4": Quantization(experts=W4A8_MXFP4),
    "mxfp": Quantization(dense=W8A8_MXFP8, experts=W4A8_MXFP4),
}


def get_scheme(name: str | None) -> Quantization:
    if name is None:
        return Quantization()
    if name not in SCHEMES:
        raise ConfigError(f"unknown quantization {name!r}; expected one of {sorted(SCHEMES)}")
    return SCHEMES[name]


_DENSE_LEAVES = re.compile(r"(^|\.)(self_attn\.(?!kv_b_proj$)\w+|shared_experts\.\w+|"
                           r"ffn\.(gate_proj|up_proj|down_proj|routed_expert_down_proj|routed_expert_up_proj))$")
# A routed expert's matrix in a checkpoint (canonical names, models/weights.py).
EXPERT_NAME = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")


def is_dense_target(module_path: str, in_features: int) -> bool:
    """Whether the linear at `module_path` (an internal module path, or a canonical checkpoint name without
    `.weight`) is quantised by a scheme's "dense" part."""
    return bool(_DENSE_LEAVES.search(module_path)) and in_features % BLOCK == 0


class MXLinear(nn.Module):
    """A bias-free linear over an MX weight: `weight` float8 [N, K] (MXFP8) or `weight_packed` uint8 [N, K/2]
    (MXFP4), and `weight_scale` uint8 [N, K/32] — buffers named as in compressed-tensors checkpoints. This torch form
    caches the weight dequantised in the activations' dtype on first use (exact; see ops/mx_linear.py); the native
    backend's form (backends/native/modules.py NativeMXLinear) keeps only the stored bytes."""

    def __init__(self, in_features: int, out_features: int, scheme: MXScheme):
        super().__init__()
        if in_features % BLOCK:
            raise ConfigError(f"an MX linear needs in_features to be a multiple of {BLOCK}, got {in_features}")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.data_name = "weight_packed" if scheme.weight is E2M1 else "weight"
        width = in_features // 2 if scheme.weight is E2M1 else in_features
        self.register_buffer(self.data_name, torch.zeros(out_features, width, dtype=scheme.weight.dtype))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // BLOCK, dtype=torch.uint8))
        self._dense: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: MXScheme) -> "MXLinear":
        m = cls(linear.in_features, linear.out_features, scheme)
        q = quantize_mx(linear.weight.detach(), scheme.weight)
        getattr(m, m.data_name).copy_(q.data)
        m.weight_scale.copy_(q.scale)
        return m

    def set_scheme(self, scheme: MXScheme) -> None:
        """Change the activation quantisation (same weight format)."""
        if scheme.weight is not self.scheme.weight:
            raise ConfigError(f"cannot run a {self.scheme.ct_format} weight as {scheme.ct_format}")
        self.scheme = scheme

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight as the checkpoint stores it: (elements, E8M0 scales)."""
        return getattr(self, self.data_name), self.weight_scale

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self._dense is None or self._dense.dtype != dtype:
            self._dense = dequantize_mx(*self.stored(), self.scheme.weight, dtype)
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        return mx_linear(x, *self.stored(), s.weight, s.act, s.act_mode, self.dense_weight(x.dtype))

    def extra_repr(self) -> str:
        act = self.scheme.act.name if self.scheme.act else "none"
        return f"in={self.in_features}, out={self.out_features}, weight={self.scheme.weight.name}, act={act}"


class MXExperts(nn.Module):
    """Stacked routed experts with MXFP4 weights kept packed: `w{1,3}_packed [E, I, dim/2]`, `w2_packed [E, dim, I/2]`
    and `w{1,2,3}_scale` (uint8, one per 32 along each matrix's input). Each call dequantises only the selected
    experts (byte-pair LUT) in the activations' dtype, so memory stays at 4.25 bits per weight; with `scheme.act`
    set, each expert's inputs are MXFP8-quantised per 32 as well (W4A8)."""

    def __init__(self, config: ModelConfig, num_experts: int, dim: int, width: int, scheme: MXScheme):
        super().__init__()
        if scheme.weight is not E2M1:
            raise ConfigError(f"routed experts support MXFP4 weights only, got {scheme.weight.name}")
        if dim % BLOCK or width % BLOCK:
            raise ConfigError(f"MXFP4 experts need dims that are multiples of {BLOCK}, got {dim} and {width}")
        self.config, self.scheme = config, scheme
        for w, (rows, cols) in (("w1", (width, dim)), ("w3", (width, dim)), ("w2", (dim, width))):
            self.register_buffer(f"{w}_packed", torch.zeros(num_experts, rows, cols // 2, dtype=torch.uint8))
            self.register_buffer(f"{w}_scale", torch.zeros(num_experts, rows, cols // BLOCK, dtype=torch.uint8))

    @classmethod
    def from_experts(cls, experts: Experts, scheme: MXScheme) -> "MXExperts":
        E, width, dim = experts.w1.shape
        m = cls(experts.config, E, dim, width, scheme)
        for w in ("w1", "w2", "w3"):
            q = quantize_mx(getattr(experts, w).detach(), scheme.weight)
            getattr(m, f"{w}_packed").copy_(q.data)
            getattr(m, f"{w}_scale").copy_(q.scale)
        return m

    def set_scheme(self, scheme: MXScheme) -> None:
        if scheme.weight is not E2M1:
            raise ConfigError(f"routed experts support MXFP4 weights only, got {scheme.weight.name}")
        self.scheme = scheme

    def stored(self, w: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Matrix stack `w` ("w1", "w2" or "w3") as the checkpoint stores it: (packed elements, E8M0 scales)."""
        return getattr(self, f"{w}_packed"), getattr(self, f"{w}_scale")

    def expert_weight(self, w: str, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantised matrix `w` ("w1", "w2" or "w3") of expert e."""
        data, scale = self.stored(w)
        return dequantize_mx(data[e], scale[e], E2M1, dtype)

    @property
    def num_experts(self) -> int:
        return self.stored("w1")[1].shape[0]

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        return dispatch_experts(x, routing, self.num_experts, self.run_expert)

    def run_expert(self, e: int, xe: torch.Tensor) -> torch.Tensor:
        s = self.scheme

        def lin(w: str, v: torch.Tensor) -> torch.Tensor:
            data, scale = self.stored(w)
            return mx_linear(v, data[e], scale[e], E2M1, s.act, s.act_mode, self.expert_weight(w, e, v.dtype))

        return lin("w2", glu_activation(self.config, lin("w1", xe), lin("w3", xe)))


def quantize_model(model: nn.Module, q: Quantization) -> None:
    """Apply scheme `q` in place to a loaded model: unquantised target layers are quantised from their weights;
    layers already MX (from the checkpoint) switch to the scheme's activation quantisation."""
    for path, module in list(model.named_modules()):
        if q.dense is not None:
            if isinstance(module, MXLinear):
                module.set_scheme(q.dense)
            elif isinstance(module, Linear) and is_dense_target(path, module.in_features):
                replace_module(model, path, MXLinear.from_linear(module, q.dense))
        if q.experts is not None:
            if isinstance(module, MXExperts):
                module.set_scheme(q.experts)
            elif isinstance(module, Experts):
                replace_module(model, path, MXExperts.from_experts(module, q.experts))


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put `new` at module path `path` of `model`."""
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def swap_in(model: nn.Module, path: str, scheme: MXScheme) -> None:
    """Replace the unquantised layer at `path` by an empty MX layer of the same shape (filled by the loader)."""
    module = model.get_submodule(path)
    if isinstance(module, Experts):
        E, width, dim = module.w1.shape
        replace_module(model, path, MXExperts(module.config, E, dim, width, scheme))
    elif isinstance(module, nn.Linear):
        replace_module(model, path, MXLinear(module.in_features, module.out_features, scheme))
    else:
        raise ConfigError(f"{path} ({type(module).__name__}) cannot hold MX weights")


def quantized_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The MX buffers of a model by name (the loader fills them like parameters)."""
    return {f"{path}.{name}" if path else name: b
            for path, m in model.named_modules() if isinstance(m, (MXLinear, MXExperts))
            for name, b in m.named_buffers(recurse=False)}


# ---- compressed-tensors `quantization_config` ----

_CT_FORMATS = {"mxfp4-pack-quantized": E2M1, "mxfp8-quantized": E4M3}


def quantization_config_of(raw: dict) -> dict | None:
    """A checkpoint config.json's `quantization_config` (top level or under `text_config`)."""
    return raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")


def stored_schemes(qc: dict | None) -> dict[str, MXScheme]:
    """compressed-tensors format -> how weights stored in it run. A group with `input_activations` runs A8 (E4M3,
    scale rule from `observer_kwargs.scale_rule`, else the spec's default: FLOOR for MXFP8, RCEIL for MXFP4)."""
    if not qc:
        return {}
    if qc.get("quant_method") != "compressed-tensors":
        raise ConfigError(f"quantization_config: quant_method {qc.get('quant_method')!r} is not supported "
                          f"(only compressed-tensors MX formats)")
    out: dict[str, MXScheme] = {}
    for gname, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        if fmt not in _CT_FORMATS:
            raise ConfigError(f"quantization_config group {gname!r}: format {fmt!r} is not supported; expected one "
                              f"of {sorted(_CT_FORMATS)}")
        act = group.get("input_activations")
        if act:
            if act.get("num_bits") != 8 or act.get("type") != "float" or act.get("group_size", BLOCK) != BLOCK:
                raise ConfigError(f"quantization_config group {gname!r}: input_activations must be 8-bit float "
                                  f"per {BLOCK}, got {act}")
            default = ScaleMode.RCEIL if _CT_FORMATS[fmt] is E2M1 else ScaleMode.FLOOR
            mode = ScaleMode((act.get("observer_kwargs") or {}).get("scale_rule", default))
            scheme = MXScheme(_CT_FORMATS[fmt], E4M3, mode)
        else:
            scheme = MXScheme(_CT_FORMATS[fmt], None)
        if out.get(fmt, scheme) != scheme:
            raise ConfigError(f"quantization_config: two groups of format {fmt!r} disagree on activations")
        out[fmt] = scheme
    return out


def ct_group(scheme: MXScheme, targets: list[str]) -> dict:
    """A compressed-tensors config group for weights stored as `scheme`."""
    bits = 4 if scheme.weight is E2M1 else 8
    group = {"format": scheme.ct_format, "targets": targets,
             "weights": {"num_bits": bits, "type": "float", "strategy": "group", "group_size": BLOCK,
                         "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}}
    if scheme.act is not None:
        group["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": BLOCK,
                                      "symmetric": True, "dynamic": True,
                                      "observer_kwargs": {"scale_rule": scheme.act_mode.value}}
    return group
