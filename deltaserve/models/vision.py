"""The vision tower and its projector (docs/vision.md): MoonViT-V2 as K3 / K3.1 Pro ship it, and MoonViT as K2.5
ships it (the shape transformers' `kimi_k25` implements, the independent reference for the parts both share).

One image (or clip) of grid (t, gh, gw) in, gh·gw/4 text-width embeddings out:
  patch embedding (a conv of stride = kernel = patch size) + the learned 2-D position table resampled to (gh, gw)
  (+ a fixed sin/cos time row per frame when t > 1) -> pre-norm blocks (full attention within the item, 2-D RoPE
  on q and k) -> final norm -> 2x2 merge with a mean over frames -> projector.

The two variants differ only where `VisionConfig.variant` says (docs/vision.md §7):
  k3:  RMSNorm with eps = the input dtype's machine epsilon, fused bias-free wqkv (attention width qkv_size may
       differ from the width), RoPE pairs adjacent channels (2j, 2j+1), bias-free MLP, projector Linear -> GELU(erf)
       -> Linear -> RMSNorm(projector_ln_eps) without a pre-norm;
  k25: LayerNorm(eps 1e-5) with bias, separate q/k/v and output projections with biases, RoPE pairs channel j with
       j + head_dim/2, MLP with biases, projector LayerNorm per patch -> Linear -> GELU(erf) -> Linear (biases).
Both build the RoPE angles the same way: for the token at row y, column x, frequencies f_i = theta^(-4i/head_dim)
(i < head_dim/4), angles interleaved as (x f_0, y f_0, x f_1, y f_1, ...)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError

VARIANTS = ("k3", "k25")


@dataclass(frozen=True)
class VisionConfig:
    variant: str = "k3"
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    pos_emb_mode: str = "bilinear"  # how the position table is resampled (F.interpolate mode)
    num_layers: int = 27
    hidden_size: int = 1024
    num_heads: int = 12
    qkv_size: int = 1536  # attention width (k25: = hidden_size)
    intermediate_size: int = 4096
    merge_kernel: tuple[int, int] = (2, 2)
    text_hidden_size: int = 7168
    projector_ln_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError(f"vision variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.qkv_size % self.num_heads or (self.qkv_size // self.num_heads) % 4:
            raise ConfigError(f"vision qkv_size {self.qkv_size} must split into {self.num_heads} heads whose "
                              f"width is a multiple of 4 (2-D RoPE)")
        if self.variant == "k25" and self.qkv_size != self.hidden_size:
            raise ConfigError("the k25 vision tower's attention width is its hidden size")

    @property
    def head_dim(self) -> int:
        return self.qkv_size // self.num_heads

    @classmethod
    def from_dict(cls, raw: dict, text_hidden_size: int) -> "VisionConfig":
        """A K3 `vision_config` (model_type kimi_k3_vision; docs/vision.md §1 gives its keys and their aliases). A
        value this tower does not implement is refused naming the key."""
        for key, only in (("pos_emb_type", "divided_fixed"), ("merge_type", "sd2_tpool"),
                          ("mm_projector_type", "patchmergerv2"), ("video_attn_type", "spatial_temporal"),
                          ("norm_type", "rmsnorm"), ("mlp_type", "mlp2"), ("activation_func", "gelu_pytorch_tanh"),
                          ("projector_hidden_act", "gelu")):
            if raw.get(key, only) != only:
                raise ConfigError(f"vision_config.{key} {raw[key]!r} is not supported (only {only!r})")
        for key in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
            if raw.get(key, False):
                raise ConfigError(f"vision_config.{key}: the K3 tower has no biases")

        def get(name: str, alias: str | None, default):
            return raw.get(name, raw.get(alias, default)) if alias else raw.get(name, default)

        d = cls()
        merge = raw.get("merge_kernel_size", list(d.merge_kernel))
        return cls("k3", int(raw.get("patch_size", d.patch_size)),
                   int(raw.get("init_pos_emb_height", d.pos_emb_height)),
                   int(raw.get("init_pos_emb_width", d.pos_emb_width)),
                   int(raw.get("init_pos_emb_time", d.pos_emb_time)),
                   str(raw.get("pos_emb_interpolation_mode", d.pos_emb_mode)),
                   int(get("vt_num_hidden_layers", "num_hidden_layers", d.num_layers)),
                   int(get("vt_hidden_size", "hidden_size", d.hidden_size)),
                   int(get("vt_num_attention_heads", "num_attention_heads", d.num_heads)),
                   int(raw.get("qkv_hidden_size", d.qkv_size)),
                   int(get("vt_intermediate_size", "intermediate_size", d.intermediate_size)),
                   (int(merge[0]), int(merge[1])), text_hidden_size,
                   float(raw.get("projector_ln_eps", d.projector_ln_eps)))


def position_table(table: torch.Tensor, gh: int, gw: int, mode: str) -> torch.Tensor:
    """The learned [H, W, D] table resampled to a (gh, gw) grid, flattened row-major to [gh·gw, D]; the table itself
    at its own size."""
    if (gh, gw) == tuple(table.shape[:2]):
        return table.reshape(gh * gw, -1)
    grid = F.interpolate(table.permute(2, 0, 1).unsqueeze(0).float(), size=(gh, gw), mode=mode, align_corners=False)
    return grid[0].permute(1, 2, 0).reshape(gh * gw, -1).to(table.dtype)


def time_table(frames: int, dim: int) -> torch.Tensor:
    """The fixed per-frame rows [frames, dim]: sin(tau·w_i) then cos(tau·w_i), w_i = 10000^(-2i/dim)."""
    omega = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(frames, dtype=torch.float32)[:, None] * omega
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def rope_angles(gh: int, gw: int, head_dim: int, theta: float) -> torch.Tensor:
    """[gh·gw, head_dim/2] angles of the tokens of a (gh, gw) grid in raster order: (x f_0, y f_0, x f_1, ...)."""
    freqs = theta ** (-4 * torch.arange(head_dim // 4, dtype=torch.float32) / head_dim)
    y, x = torch.meshgrid(torch.arange(gh, dtype=torch.float32), torch.arange(gw, dtype=torch.float32),
                          indexing="ij")
    xy = torch.stack([x.reshape(-1), y.reshape(-1)], dim=-1)  # [N, 2], x first
    return (xy[:, None, :] * freqs[None, :, None]).reshape(gh * gw, head_dim // 2)


def apply_rope(x: torch.Tensor, angles: torch.Tensor, adjacent: bool) -> torch.Tensor:
    """Rotate x [N, heads, head_dim] by `angles` [N, head_dim/2] in fp32: channel pairs (2j, 2j+1) when `adjacent`,
    else (j, j + head_dim/2)."""
    xf = x.float()
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    if adjacent:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        a, b = xf.chunk(2, dim=-1)
        out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.to(x.dtype)


class _Norm(nn.Module):
    """k3: RMSNorm whose eps is the input dtype's machine epsilon (the reference's eps=None: 2^-7 in bf16), no bias;
    k25: LayerNorm."""

    def __init__(self, dim: int, rms: bool):
        super().__init__()
        self.rms = rms
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = None if rms else nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:  # given explicitly: torch's eps=None resolves to fp32's epsilon inside its upcast kernel
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=torch.finfo(x.dtype).eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, eps=1e-5)


class _MLP(nn.Module):
    def __init__(self, c: VisionConfig, bias: bool):
        super().__init__()
        self.fc0 = nn.Linear(c.hidden_size, c.intermediate_size, bias=bias)
        self.fc1 = nn.Linear(c.intermediate_size, c.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """One pre-norm block; parameter names are the checkpoint's (`vision_tower.encoder.blocks.{i}.*`)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        k3, D = c.variant == "k3", c.hidden_size
        self.c = c
        self.norm0, self.norm1 = _Norm(D, k3), _Norm(D, k3)
        self.wqkv = nn.Linear(D, 3 * c.qkv_size, bias=not k3)  # rows: q, k, v, each head-major
        self.wo = nn.Linear(c.qkv_size, D, bias=not k3)
        self.mlp = _MLP(c, bias=not k3)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        c = self.c
        q, k, v = self.wqkv(self.norm0(x)).view(x.shape[0], 3, c.num_heads, c.head_dim).unbind(1)
        adjacent = c.variant == "k3"
        q, k = apply_rope(q, angles, adjacent), apply_rope(k, angles, adjacent)
        out = torch.cat([self._attend(*(t[s:s + n] for t in (q, k, v)))
                         for s, n in zip(_starts(lengths), lengths)])
        x = x + self.wo(out.reshape(x.shape[0], c.qkv_size))
        return x + self.mlp(self.norm1(x))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Full (non-causal) attention over one item's tokens, softmax in fp32; [n, heads, head_dim]."""
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(self.c.head_dim)
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(v.dtype)


def _starts(lengths: list[int]) -> list[int]:
    return [sum(lengths[:i]) for i in range(len(lengths))]


class _PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.proj = nn.Conv2d(3, c.hidden_size, c.patch_size, c.patch_size, bias=c.variant == "k25")
        self.pos_emb = nn.Module()
        self.pos_emb.weight = nn.Parameter(torch.zeros(c.pos_emb_height, c.pos_emb_width, c.hidden_size))


class _Encoder(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.num_layers))
        self.final_layernorm = _Norm(c.hidden_size, c.variant == "k3")


class VisionTower(nn.Module):
    """pixel_values [sum t·gh·gw, 3, p, p] (items concatenated, each in raster patch order, frames first) and one
    (t, gh, gw) per item -> the encoder's merged groups [sum gh·gw/4, 4·hidden] (2x2 window row-major, frames
    averaged), items in order. Parameter names are the checkpoint's under `vision_tower.` (docs/vision.md)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.c = c
        self.patch_embed = _PatchEmbed(c)
        self.encoder = _Encoder(c)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        c = self.c
        x = self.patch_embed.proj(pixel_values).flatten(1)
        pos, angles = [], []
        for t, gh, gw in grids:
            spatial = position_table(self.patch_embed.pos_emb.weight, gh, gw, c.pos_emb_mode)
            frames = time_table(t, c.hidden_size).to(spatial.dtype) if t > 1 else spatial.new_zeros(1, 1)
            pos.append((spatial[None] + frames[:, None]).reshape(t * gh * gw, -1))
            angles.append(rope_angles(gh, gw, c.head_dim, c.rope_theta).repeat(t, 1))
        x = x + torch.cat(pos).to(x.dtype)
        angles_all = torch.cat(angles)
        lengths = [t * gh * gw for t, gh, gw in grids]
        for block in self.encoder.blocks:
            x = block(x, angles_all, lengths)
        return merge(self.encoder.final_layernorm(x), grids, c.merge_kernel)


def merge(x: torch.Tensor, grids: list[tuple[int, int, int]], kernel: tuple[int, int]) -> torch.Tensor:
    """`sd2_tpool`: per item, group each kh x kw window (row-major inside it) and average over frames;
    [sum gh·gw/(kh·kw), kh·kw·D] in merged-grid raster order."""
    kh, kw = kernel
    out, start = [], 0
    for t, gh, gw in grids:
        item = x[start:start + t * gh * gw].view(t, gh // kh, kh, gw // kw, kw, -1)
        out.append(item.permute(0, 1, 3, 2, 4, 5).mean(0).reshape((gh // kh) * (gw // kw), -1))
        start += t * gh * gw
    return torch.cat(out)


class Projector(nn.Module):
    """Merged groups [M, kh·kw·D] -> text-width embeddings [M, text_hidden_size]. k3 (`patchmergerv2`): bias-free
    Linear -> GELU(erf) -> Linear -> RMSNorm(projector_ln_eps); k25: LayerNorm(D) on each patch first, biases.
    Parameter names are the checkpoint's under `mm_projector.` (`proj.0`, `proj.2`, `post_norm`)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        k3, width = c.variant == "k3", c.hidden_size * c.merge_kernel[0] * c.merge_kernel[1]
        self.c = c
        self.pre_norm = None if k3 else nn.LayerNorm(c.hidden_size, eps=c.projector_ln_eps)
        self.proj = nn.Sequential(nn.Linear(width, width, bias=not k3), nn.GELU(),
                                  nn.Linear(width, c.text_hidden_size, bias=not k3))
        self.post_norm = None
        if k3:
            self.post_norm = nn.Module()
            self.post_norm.weight = nn.Parameter(torch.ones(c.text_hidden_size))

    def forward(self, groups: torch.Tensor) -> torch.Tensor:
        if self.pre_norm is not None:
            groups = self.pre_norm(groups.view(groups.shape[0], -1, self.c.hidden_size)).flatten(1)
        z = self.proj(groups)
        if self.post_norm is None:
            return z
        return F.rms_norm(z, (z.shape[-1],), self.post_norm.weight, eps=self.c.projector_ln_eps)


class VisionModel(nn.Module):
    """The tower and the projector as a checkpoint stores them (`vision_tower.*`, `mm_projector.*`)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.config = c
        self.vision_tower = VisionTower(c)
        self.mm_projector = Projector(c)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Patches of one or more items -> [sum gh·gw/4, text_hidden_size], items in order."""
        dtype = self.mm_projector.proj[0].weight.dtype
        return self.mm_projector(self.vision_tower(pixel_values.to(dtype), grids))


# vLLM's internal names of the projector's linears, accepted on load.
_ALIASES = {"mm_projector.linear_1.": "mm_projector.proj.0.", "mm_projector.linear_2.": "mm_projector.proj.2."}


def load_vision(path: Path, dtype: torch.dtype = torch.float32) -> VisionModel | None:
    """The vision model of a K3 checkpoint folder, or None when it stores no vision tensors. Every tower and
    projector tensor must be there, in its shape (CheckpointError naming the first that is not)."""
    from safetensors import safe_open

    from ..errors import CheckpointError
    from .loader import read_config, tensor_files

    files = {name: f for name, f in tensor_files(Path(path)).items()
             if name.startswith(("vision_tower.", "mm_projector."))}
    if not files:
        return None
    raw = read_config(Path(path))
    text = raw.get("text_config", raw)
    model = VisionModel(VisionConfig.from_dict(raw.get("vision_config") or {}, int(text["hidden_size"])))
    params = dict(model.named_parameters())
    seen = set()
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    with torch.no_grad():
        for f, names in by_file.items():
            with safe_open(f, "pt") as sf:
                for name in names:
                    target = next((name.replace(a, b, 1) for a, b in _ALIASES.items() if name.startswith(a)), name)
                    if target not in params:
                        raise CheckpointError(f"unexpected vision tensor {name!r}: the vision_config has no such "
                                              f"weight")
                    value = sf.get_tensor(name)
                    if tuple(value.shape) != tuple(params[target].shape):
                        raise CheckpointError(f"vision tensor {name!r} is {list(value.shape)}; the vision_config "
                                              f"makes it {list(params[target].shape)}")
                    params[target].copy_(value)
                    seen.add(target)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"the checkpoint lacks vision tensor {missing[0]!r} ({len(missing)} missing)")
    return model.to(dtype).eval()
