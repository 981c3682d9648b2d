"""ModelConfig: one normalised view of the config.json of every supported family.

Families (routed on the top-level `model_type`, never on `text_config` alone, spec docs/model.md §1):
  kimi_k3      K3, or K3.1 Pro when a `dsa_config` block and indexer tensors are present
  kimi_linear  Kimi-Linear (KDA + NoPE MLA + MoE)
  deepseek_v3  MLA with RoPE/YaRN + grouped noaux_tc MoE
  deepseek_v32 deepseek_v3 + the lightning indexer (DSA)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ConfigError

log = logging.getLogger(__name__)

FAMILIES = ("kimi_k3", "kimi_linear", "deepseek_v3", "deepseek_v32")

# dsa_config spellings (docs/model.md §2.4): first match wins.
_DSA_HEADS = ("index_n_heads", "n_heads", "num_heads", "head_count", "index_head_count", "num_index_heads")
_DSA_HEAD_DIM = ("index_head_dim", "head_dim", "key_length", "index_key_length")
_DSA_TOPK = ("index_topk", "topk", "top_k", "index_top_k", "num_selected_tokens")
_DSA_LAYERS = ("dsa_layers", "layers", "layer_ids", "indexer_layers", "full_attn_layers")
_DSA_TYPES = ("types", "layer_types", "indexer_types")
_DSA_EPS = ("eps", "norm_eps", "k_norm_eps", "indexer_norm_eps", "layer_norm_eps")
_DSA_ROPE = ("rope_head_dim", "qk_rope_head_dim", "use_rope", "rope")
_DSA_SHARE = ("index_share", "shared", "skip_topk", "use_index_cache")
_DSA_CACHE_DTYPE = ("indexer_kv_dtype", "index_k_dtype")

# HF attribute_map aliases of KimiLinearConfig and DeepSeek spellings (docs/model.md §2.6).
_ALIASES = {
    "num_experts": ("num_experts", "n_routed_experts", "num_local_experts"),
    "num_experts_per_token": ("num_experts_per_token", "num_experts_per_tok"),
    "num_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "moe_renormalize": ("moe_renormalize", "norm_topk_prob"),
    "num_expert_group": ("num_expert_group", "n_group"),
    "max_position_embeddings": ("max_position_embeddings", "model_max_length"),
    "moe_router_activation_func": ("moe_router_activation_func", "scoring_func"),
}


def _first(d: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        if k in d and d[k] is not None:
            return k, d[k]
    return None, None


@dataclass
class ModelConfig:
    """Everything the layers need, resolved once at load. Layer lists are 0-based here."""

    family: str
    architectures: list[str]
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # MLA
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    mla_use_output_gate: bool
    mla_norm_eps: float  # eps of q_a_layernorm / kv_a_layernorm (docs/model.md §16: HF reference uses 1e-6)
    rope_theta: float
    rope_scaling: dict | None
    # FFN
    hidden_act: str
    situ_beta: float | None
    situ_linear_beta: float | None
    intermediate_size: int
    num_experts: int | None
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    moe_renormalize: bool
    router_activation: str
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    first_k_dense_replace: int
    moe_layer_freq: int
    routed_expert_hidden_size: int | None
    latent_moe_use_norm: bool
    # AttnRes
    attn_res_block_size: int | None
    # KDA (1-based lists as in the checkpoint are converted to 0-based sets)
    kda_layers: tuple[int, ...]
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_size: int
    kda_full_rank_gate: bool
    kda_gate_lower_bound: float | None
    # DSA
    dsa_layers: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_norm_eps: float
    index_use_rope: bool
    index_cache_dtype: str | None
    # misc
    num_nextn_predict_layers: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    media_placeholder_token_id: int | None
    torch_dtype: str | None
    quantization_config: dict | None
    raw: dict = field(repr=False, default_factory=dict)

    # ---- derived plan (docs/model.md §2.7) ----
    @property
    def is_k31(self) -> bool:
        return self.family == "kimi_k3" and bool(self.dsa_layers)

    @property
    def has_dsa(self) -> bool:
        return bool(self.dsa_layers)

    @property
    def uses_rope(self) -> bool:
        return not self.mla_use_nope

    def attn_kind(self, layer: int) -> str:
        """'kda', 'dsa' or 'mla' for a 0-based layer (MTP layers >= num_layers are MLA or DSA)."""
        if layer in self.kda_layers:
            return "kda"
        return "dsa" if layer in self.dsa_layers else "mla"

    def ffn_kind(self, layer: int) -> str:
        moe = self.num_experts and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0
        return "moe" if moe else "dense"

    def attnres_write(self, layer: int) -> bool:
        return self.attn_res_block_size is not None and layer % self.attn_res_block_size == 0

    @property
    def mla_layers(self) -> list[int]:
        return [l for l in range(self.num_layers) if l not in self.kda_layers]

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # ---- construction ----
    @classmethod
    def from_dict(cls, config: Mapping[str, Any], tensor_names: set[str] | None = None,
                  tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> "ModelConfig":
        """Normalise a config.json dict. `tensor_shapes` (checkpoint names -> shapes), when given, is used for the
        K3.1 signals and indexer geometry (docs/model.md §2.4); without tensors the config alone decides (as when
        writing a new checkpoint). Raises ConfigError naming the offending key."""
        shapes = dict(tensor_shapes or {})
        names = None if tensor_names is None and tensor_shapes is None else set(tensor_names or shapes.keys())
        top = dict(config)
        family = top.get("model_type")
        if family not in FAMILIES:
            raise ConfigError(f"config.json: unsupported model_type {family!r}; supported: {', '.join(FAMILIES)}")
        if family == "kimi_k3":
            if not isinstance(top.get("text_config"), dict):
                raise ConfigError("config.json: model_type 'kimi_k3' needs a 'text_config' object")
            text = dict(top["text_config"])
            for k in ("hidden_size", "vocab_size"):
                if k in top and k not in text:
                    text[k] = top[k]
            if "quantization_config" in top and "quantization_config" not in text:
                text["quantization_config"] = top["quantization_config"]
            if "dsa_config" in top and "dsa_config" not in text:
                text["dsa_config"] = top["dsa_config"]
        else:
            text = top
        return _build(family, top, text, names, shapes)


def _req(text: Mapping[str, Any], key: str, kind=int):
    if key not in text or text[key] is None:
        raise ConfigError(f"config.json: missing required key {key!r}")
    try:
        return kind(text[key])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.json: key {key!r} has invalid value {text[key]!r}") from e


def _alias(text: Mapping[str, Any], name: str, default=None):
    _, v = _first(text, _ALIASES[name])
    return default if v is None else v


def _build(family: str, top: dict, text: dict, names: set[str] | None, shapes: Mapping[str, tuple]) -> ModelConfig:
    kimi = family in ("kimi_k3", "kimi_linear")
    L = _req(text, "num_hidden_layers")
    hidden = _req(text, "hidden_size")
    num_heads = _req(text, "num_attention_heads")

    # ---- layer plan ----
    kda_layers: tuple[int, ...] = ()
    lac = text.get("linear_attn_config") if kimi else None
    kda_heads = kda_dim = conv = 0
    full_rank = False
    lower_bound = None
    if kimi:
        if not isinstance(lac, dict):
            raise ConfigError("config.json: missing required key 'linear_attn_config'")
        kda1 = [int(x) for x in lac.get("kda_layers") or []]
        full1 = [int(x) for x in lac.get("full_attn_layers") or []]
        if set(kda1) & set(full1) or set(kda1) | set(full1) != set(range(1, L + 1)):
            raise ConfigError(
                "config.json: linear_attn_config 'kda_layers' and 'full_attn_layers' must partition layers "
                f"1..{L} (1-based); got kda_layers={kda1}, full_attn_layers={full1}")
        kda_layers = tuple(sorted(l - 1 for l in kda1))
        kda_heads = _req(lac, "num_heads")
        kda_dim = _req(lac, "head_dim")
        conv = int(lac.get("short_conv_kernel_size", 4))
        full_rank = bool(lac.get("use_full_rank_gate", False))
        lower_bound = lac.get("gate_lower_bound")
        if lower_bound is not None:
            lower_bound = float(lower_bound)
            if not -5.0 <= lower_bound < 0.0:
                raise ConfigError(f"config.json: linear_attn_config 'gate_lower_bound' must be in [-5, 0), got {lower_bound}")

    mla_layers = [l for l in range(L) if l not in kda_layers]
    dsa = _dsa_plan(family, text, mla_layers, names, shapes)

    # ---- MoE ----
    num_experts = _alias(text, "num_experts")
    if num_experts is not None:
        num_experts = int(num_experts)
    router_act = str(_alias(text, "moe_router_activation_func", "sigmoid"))
    if router_act not in ("sigmoid", "softmax"):
        raise ConfigError(f"config.json: unsupported router activation {router_act!r} (key moe_router_activation_func)")
    hidden_act = str(text.get("hidden_act", "silu"))
    if hidden_act not in ("silu", "situ"):
        raise ConfigError(f"config.json: unsupported 'hidden_act' {hidden_act!r}")
    situ_beta = text.get("activation_situ_beta")
    if hidden_act == "situ" and situ_beta is None:
        raise ConfigError("config.json: hidden_act 'situ' needs key 'activation_situ_beta'")

    rms_eps = float(text.get("rms_norm_eps", 1e-5 if kimi else 1e-6))
    rope_scaling = text.get("rope_scaling") or text.get("rope_parameters")
    rope_theta = text.get("rope_theta")
    if rope_theta is None and isinstance(rope_scaling, dict):
        rope_theta = rope_scaling.get("rope_theta")
    if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) in (
            "default", None):
        rope_scaling = None

    eos = text.get("eos_token_id", top.get("eos_token_id"))
    eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    mtp = int(text.get("num_nextn_predict_layers", 0) or 0)
    if family == "kimi_k3" and text.get("routed_expert_hidden_size") is None and num_experts:
        log.info("kimi_k3 config without routed_expert_hidden_size: plain (non-latent) MoE")
    q_lora = text.get("q_lora_rank")

    return ModelConfig(
        family=family,
        architectures=list(top.get("architectures") or []),
        vocab_size=_req(text, "vocab_size"),
        hidden_size=hidden,
        num_layers=L,
        rms_norm_eps=rms_eps,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))),
        num_heads=num_heads,
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=_req(text, "kv_lora_rank"),
        qk_nope_head_dim=_req(text, "qk_nope_head_dim"),
        qk_rope_head_dim=_req(text, "qk_rope_head_dim"),
        v_head_dim=_req(text, "v_head_dim"),
        mla_use_nope=bool(text.get("mla_use_nope", family == "kimi_linear")) if kimi else False,
        mla_use_output_gate=bool(text.get("mla_use_output_gate", False)),
        mla_norm_eps=1e-6,
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rope_scaling=dict(rope_scaling) if isinstance(rope_scaling, dict) else None,
        hidden_act=hidden_act,
        situ_beta=None if situ_beta is None else float(situ_beta),
        situ_linear_beta=(None if text.get("activation_situ_linear_beta") is None
                          else float(text["activation_situ_linear_beta"])),
        intermediate_size=_req(text, "intermediate_size"),
        num_experts=num_experts,
        num_experts_per_token=int(_alias(text, "num_experts_per_token", 1)),
        num_shared_experts=int(_alias(text, "num_shared_experts", 0) or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        moe_renormalize=bool(_alias(text, "moe_renormalize", True)),
        router_activation=router_act,
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        num_expert_group=int(_alias(text, "num_expert_group", 1) or 1),
        topk_group=int(text.get("topk_group", 1) or 1),
        first_k_dense_replace=int(text.get("first_k_dense_replace", 0)),
        moe_layer_freq=int(text.get("moe_layer_freq", 1)),
        routed_expert_hidden_size=(None if text.get("routed_expert_hidden_size") is None
                                   else int(text["routed_expert_hidden_size"])),
        latent_moe_use_norm=bool(text.get("latent_moe_use_norm", False)),
        attn_res_block_size=(None if text.get("attn_res_block_size") is None
                             else int(text["attn_res_block_size"])),
        kda_layers=kda_layers,
        kda_num_heads=kda_heads,
        kda_head_dim=kda_dim,
        kda_conv_size=conv,
        kda_full_rank_gate=full_rank,
        kda_gate_lower_bound=lower_bound,
        dsa_layers=dsa["layers"],
        index_n_heads=dsa["heads"],
        index_head_dim=dsa["head_dim"],
        index_topk=dsa["topk"],
        index_norm_eps=dsa["eps"] if dsa["eps"] is not None else rms_eps,
        index_use_rope=family == "deepseek_v32",
        index_cache_dtype=dsa["cache_dtype"],
        num_nextn_predict_layers=mtp,
        max_position_embeddings=int(_alias(text, "max_position_embeddings", 4096)),
        bos_token_id=text.get("bos_token_id", top.get("bos_token_id")),
        eos_token_ids=eos_ids,
        media_placeholder_token_id=top.get("media_placeholder_token_id"),
        torch_dtype=text.get("torch_dtype") or text.get("dtype") or top.get("torch_dtype") or top.get("dtype"),
        quantization_config=text.get("quantization_config"),
        raw=dict(top),
    )


def _indexer_shape(shapes: Mapping[str, tuple], layer: int, leaf: str) -> tuple | None:
    for name, shape in shapes.items():
        if name.endswith(f"layers.{layer}.self_attn.indexer.{leaf}"):
            return tuple(shape)
    return None


def _dsa_plan(family: str, text: dict, mla_layers: list[int], names: set[str] | None, shapes: Mapping[str, tuple]) -> dict:
    empty = {"layers": (), "heads": 0, "head_dim": 0, "topk": 0, "eps": None, "cache_dtype": None}
    if family in ("kimi_linear", "deepseek_v3"):
        return empty
    if family == "deepseek_v32":
        for k in ("index_n_heads", "index_head_dim", "index_topk"):
            _req(text, k)
        return {"layers": tuple(mla_layers), "heads": int(text["index_n_heads"]),
                "head_dim": int(text["index_head_dim"]), "topk": int(text["index_topk"]), "eps": 1e-6,
                "cache_dtype": None}

    # kimi_k3: K3.1 iff dsa_config (or flat DeepSeek keys) AND indexer tensors; exactly one signal is an error.
    block = text.get("dsa_config")
    flat = {k: text[k] for k in ("index_n_heads", "index_head_dim", "index_topk") if k in text}
    has_cfg = isinstance(block, dict) or bool(flat)
    has_tensors = has_cfg if names is None else any(".self_attn.indexer." in n for n in names)
    if not has_cfg and not has_tensors:
        return empty
    if has_cfg != has_tensors:
        what = "a dsa_config block but no self_attn.indexer.* tensors" if has_cfg else \
            "self_attn.indexer.* tensors but no dsa_config block"
        raise ConfigError(f"kimi_k3 checkpoint has {what}; K3 vs K3.1 Pro is ambiguous (key 'dsa_config')")
    cfg = dict(flat)
    if isinstance(block, dict):
        cfg.update(block)
    used: dict[str, str] = {}

    def pick(keys: tuple[str, ...], what: str):
        k, v = _first(cfg, keys)
        if k is not None:
            used[what] = k
        return v

    heads, head_dim, topk = pick(_DSA_HEADS, "heads"), pick(_DSA_HEAD_DIM, "head_dim"), pick(_DSA_TOPK, "topk")
    layers1 = pick(_DSA_LAYERS, "layers")
    types = pick(_DSA_TYPES, "types")
    eps, rope = pick(_DSA_EPS, "eps"), pick(_DSA_ROPE, "rope")
    share, cache_dtype = pick(_DSA_SHARE, "share"), pick(_DSA_CACHE_DTYPE, "cache_dtype")
    unknown = set(cfg) - set(used.values()) - set(flat)
    if unknown:
        log.warning("dsa_config: unrecognised keys kept verbatim and ignored: %s",
                    {k: cfg[k] for k in sorted(unknown)})
    log.debug("dsa_config keys matched: %s", used)
    if topk is None:
        raise ConfigError("dsa_config: missing required key 'index_topk' (or topk/top_k/index_top_k)")
    if rope not in (None, 0, False):
        raise ConfigError(f"dsa_config: key {used['rope']!r}={rope!r}: RoPE in the K3.1 indexer is not supported")
    if share not in (None, 0, False):
        raise ConfigError(f"dsa_config: key {used['share']!r}={share!r}: index sharing is not supported")
    if layers1 is None and types is not None:
        layers1 = [i + 1 for i, t in enumerate(types) if t not in (None, "", "none", "dense", False, 0)]
    if layers1 is None:
        raise ConfigError("dsa_config: missing required key 'dsa_layers' (1-based layer list)")
    layers = tuple(sorted(int(l) - 1 for l in layers1))
    if list(layers) != sorted(mla_layers):
        raise ConfigError(f"dsa_config: key {used.get('layers', 'types')!r} lists layers {list(layers1)} but the MLA "
                          f"layers are {[l + 1 for l in mla_layers]} (1-based); they must be equal")
    # Geometry from tensor shapes is unambiguous; config values are cross-checked against it.
    wk = _indexer_shape(shapes, layers[0], "wk.weight")
    wp = _indexer_shape(shapes, layers[0], "weights_proj.weight")
    if wk is not None and wp is not None:
        d_i, h_i = int(wk[0]), int(wp[0])
        for what, cfg_v, shape_v in (("heads", heads, h_i), ("head_dim", head_dim, d_i)):
            if cfg_v is not None and int(cfg_v) != shape_v:
                raise ConfigError(f"dsa_config: key {used[what]!r}={cfg_v} disagrees with the indexer tensor "
                                  f"shapes ({shape_v})")
        heads, head_dim = h_i, d_i
    if heads is None or head_dim is None:
        raise ConfigError("dsa_config: indexer heads/head_dim neither in the config nor derivable from tensors")
    return {"layers": layers, "heads": int(heads), "head_dim": int(head_dim), "topk": int(topk),
            "eps": None if eps is None else float(eps), "cache_dtype": cache_dtype}
