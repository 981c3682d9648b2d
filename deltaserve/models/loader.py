"""Load a checkpoint folder (config.json + model.safetensors or a sharded index) into a model.

Every parameter must be filled exactly once from a tensor of the right shape: a missing, unexpected or mis-shaped
tensor is a CheckpointError naming it (and both shapes). Never unpickles anything: safetensors and JSON only.

Quantization (layers/quantized.py): layers whose tensors the checkpoint stores in an MX format (compressed-tensors
`weight_packed`/`weight_scale`, or a float8 `weight` with a `weight_scale`) become MX layers before loading and are
filled with the stored bytes as they are, run as the checkpoint's `quantization_config` says; a `quantization`
scheme then quantises the remaining target layers at load time.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..config import ModelConfig
from ..distributed import Shard, split_dim
from ..distributed import shard as cut  # `shard` names the rank's Shard here
from ..errors import CheckpointError, ConfigError
from ..layers.quantized import (W4A16_MXFP4, W8A16_MXFP8, MXExperts, MXLinear, get_scheme, quantization_config_of,
                                quantize_model, quantized_tensors, stored_schemes, swap_in)
from .base import CausalLM
from .registry import model_class
from .weights import Target, canonical, targets

log = logging.getLogger(__name__)

# Parameters kept in fp32 whatever the model dtype (docs/model.md §14.3, §15.1).
FP32_PARAMS = ("A_log", "dt_bias", "_conv1d.weight", "e_score_correction_bias")
# Parameters a checkpoint may omit, with the value used instead.
_OPTIONAL = ("indexer.k_norm.bias",)
_PROGRESS_MIN_BYTES = 256 << 20
_MX_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def read_config(path: Path) -> dict:
    f = path / "config.json"
    if not f.is_file():
        raise ConfigError(f"{path}: no config.json")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: invalid JSON ({e})") from e


def tensor_files(path: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> file holding it, for single-file and sharded checkpoints."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing 'weight_map'")
        return {name: path / fname for name, fname in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    by_file = defaultdict(list)
    for name, f in files.items():
        by_file[f].append(name)
    shapes = {}
    for f, names in by_file.items():
        if not f.is_file():
            raise CheckpointError(f"missing shard {f.name} (listed in model.safetensors.index.json)")
        with safe_open(f, "pt") as sf:
            present = set(sf.keys())
            for n in names:
                if n not in present:
                    raise CheckpointError(f"tensor {n!r} is listed in the index but absent from {f.name}")
                shapes[n] = tuple(sf.get_slice(n).get_shape())
    return shapes


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    raw = read_config(path)
    return ModelConfig.from_dict(raw, tensor_shapes=tensor_shapes(tensor_files(path)))


def load_model(path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
               quantization: str | None = None, shard: Shard = Shard()) -> CausalLM:
    """Build the family's model from a checkpoint folder and fill every parameter from its safetensors.
    `quantization` ("w8a8-mxfp8", "w4a8-mxfp4", "mxfp" or None) is applied on top of whatever the checkpoint
    stores quantised; a checkpoint written by `deltaserve quantize` needs none. For one rank of a tensor-parallel
    group (`shard`) the model holds that rank's part and only those slices are read (distributed/sharding.py):
    the other experts' tensors not at all, a split tensor as its slice (a tensor stored in another layout, read
    whole, converted, then cut)."""
    path = Path(path)
    torch_dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if torch_dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"unsupported dtype {dtype!r}; use float32 or bfloat16")
    scheme = get_scheme(quantization)
    raw = read_config(path)
    files = tensor_files(path)
    shapes = tensor_shapes(files)
    config = ModelConfig.from_dict(raw, tensor_shapes=shapes)
    shard.layout.check(config, {})
    with torch.device(device):
        model = model_class(config)(config, shard=shard)
    _swap_stored_mx(model, config, shapes, stored_schemes(quantization_config_of(raw)))
    params = dict(model.named_parameters()) | quantized_tensors(model)
    plan, mtp_seen = _plan(config, shapes, params)
    if shard.size > 1 and shard.expert_parallel and config.num_experts:
        plan = _held_targets(plan, shard.span(config.num_experts))
    _check_coverage(config, model, params, plan, mtp_seen)

    total = sum(_nbytes(shapes[n], 2) for n in shapes)
    bar = tqdm(total=len(plan), desc="Loading weights", unit="tensor", disable=total < _PROGRESS_MIN_BYTES)
    handles: dict[Path, object] = {}
    try:
        with torch.no_grad():
            for name, tgts in plan.items():
                f = files[name]
                if f not in handles:
                    handles[f] = safe_open(f, "pt", device="cpu").__enter__()
                tensor = _read(handles[f], name, tgts, shard)
                for t in tgts:
                    value = t.convert(tensor) if t.convert else tensor
                    if t.convert is not None:
                        value = _cut(value, split_dim(t.param, shard.layout), shard, name)
                    dest = params[t.param] if t.expert is None else params[t.param][t.expert]
                    if tuple(value.shape) != tuple(dest.shape):
                        raise CheckpointError(f"tensor {name!r} has shape {list(value.shape)} but the config "
                                              f"implies {list(dest.shape)}")
                    _check_mx_tensor(name, value, dest)
                    dest.copy_(value)
                bar.update(1)
    finally:
        bar.close()
        for h in handles.values():
            h.__exit__(None, None, None)
    if config.tie_word_embeddings and not any(t.param == "lm_head.weight" for ts in plan.values() for t in ts):
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        quantize_model(model, scheme)
    _cast(model, torch_dtype)
    model.requires_grad_(False)
    model.eval()
    return model


def _held_targets(plan: dict, span: range) -> dict:
    """The plan of one expert-parallel rank holding experts `span`: those renumbered from 0, the others' tensors
    dropped (never read)."""
    held = {}
    for name, tgts in plan.items():
        kept = [t if t.expert is None else Target(t.param, t.expert - span.start, t.convert)
                for t in tgts if t.expert is None or t.expert in span]
        if kept:
            held[name] = kept
    return held


def _read(handle, name: str, tgts: list[Target], shard: Shard) -> torch.Tensor:
    """Tensor `name` as this rank needs it: its slice when the one target takes the stored layout (an expert's
    tensor is its stacked parameter less the expert dimension), else the whole (converted and cut afterwards)."""
    if shard.size == 1 or len(tgts) != 1 or tgts[0].convert is not None:
        return handle.get_tensor(name)
    dim = split_dim(tgts[0].param, shard.layout)
    if dim is not None and tgts[0].expert is not None:
        dim = None if shard.expert_parallel else dim - 1
    if dim is None:
        return handle.get_tensor(name)
    stored = handle.get_slice(name)
    shape = stored.get_shape()
    if shape[dim] % shard.size:
        raise CheckpointError(f"tensor {name!r} {list(shape)}: dimension {dim} does not divide by "
                              f"tensor_parallel_size = {shard.size}")
    k = shape[dim] // shard.size
    return stored[tuple(slice(shard.rank * k, (shard.rank + 1) * k) if i == dim else slice(None)
                        for i in range(len(shape)))]


def _cut(value: torch.Tensor, dim: int | None, shard: Shard, name: str) -> torch.Tensor:
    if dim is not None and value.shape[dim] % shard.size:
        raise CheckpointError(f"tensor {name!r} {list(value.shape)}: dimension {dim} does not divide by "
                              f"tensor_parallel_size = {shard.size}")
    return cut(value, dim, shard.rank, shard.size)


def _swap_stored_mx(model: CausalLM, config: ModelConfig, shapes: dict, schemes: dict) -> None:
    """Turn every layer the checkpoint stores in an MX format (it has a `weight_scale`) into an empty MX layer."""
    layers: dict[str, str] = {}
    for name, shape in shapes.items():
        canon = canonical(name)
        if canon is None or not canon.endswith(".weight_scale"):
            continue
        tgts = targets(canon, config, shape) or []
        packed = name[: -len("weight_scale")] + "weight_packed" in shapes
        for t in tgts:
            layers[t.param.rsplit(".", 1)[0]] = "mxfp4-pack-quantized" if packed else "mxfp8-quantized"
    for module_path, fmt in layers.items():
        default = W4A16_MXFP4 if fmt == "mxfp4-pack-quantized" else W8A16_MXFP8
        try:
            module = model.get_submodule(module_path)
        except AttributeError as e:
            raise CheckpointError(f"the checkpoint stores {module_path} quantised, but the model has no such "
                                  f"layer") from e
        if not isinstance(module, (MXLinear, MXExperts)):
            swap_in(model, module_path, schemes.get(fmt, default))


def _check_mx_tensor(name: str, value: torch.Tensor, dest: torch.Tensor) -> None:
    """MX bytes go only into MX buffers of the same dtype, and no scale may be NaN (E8M0 255) (docs/ops.md §8)."""
    if value.dtype != dest.dtype and (value.dtype in _MX_DTYPES or dest.dtype in _MX_DTYPES):
        raise CheckpointError(f"tensor {name!r} is {value.dtype} but its layer expects {dest.dtype} (a quantised "
                              f"tensor without its weight_scale, or the reverse)")
    if name.endswith("weight_scale") and bool((value == 255).any()):
        raise CheckpointError(f"tensor {name!r} holds NaN E8M0 scales (byte 255)")


def _nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    n = itemsize
    for s in shape:
        n *= s
    return n


def _plan(config: ModelConfig, shapes: dict, params: dict) -> tuple[dict, set[int]]:
    plan, mtp_seen = {}, set()
    for name, shape in shapes.items():
        canon = canonical(name)
        if canon is None:
            if name.startswith(("vision_tower.", "mm_projector.", "multi_modal_projector.", "vision_model.")):
                if config.family != "kimi_k3":
                    raise CheckpointError(f"unexpected vision tensor {name!r} in a {config.family} checkpoint")
            continue
        tgts = targets(canon, config, shape)
        if tgts is None or any(t.param not in params for t in tgts):
            raise CheckpointError(f"unexpected tensor {name!r} (shape {list(shape)}): the config has no such weight")
        if canon.startswith("layers.") and int(canon.split(".")[1]) >= config.num_layers:
            mtp_seen.add(int(canon.split(".")[1]) - config.num_layers)
        if tgts:
            plan[name] = tgts
    return plan, mtp_seen  # the vision tower's tensors are models/vision.py's (load_vision)


def _check_coverage(config: ModelConfig, model: CausalLM, params: dict, plan: dict, mtp_seen: set[int]) -> None:
    """Every parameter (and every expert row of stacked experts) must be provided; MTP all or nothing."""
    covered: dict[str, set] = defaultdict(set)
    names_for: dict[tuple[str, int | None], str] = {}
    for name, tgts in plan.items():
        for t in tgts:
            key = (t.param, t.expert)
            if key in names_for:
                raise CheckpointError(f"tensors {names_for[key]!r} and {name!r} both provide {t.param}")
            names_for[key] = name
            covered[t.param].add(t.expert)
    if config.num_nextn_predict_layers and not mtp_seen:
        log.warning("checkpoint has no MTP tensors (num_nextn_predict_layers=%d): MTP is unavailable",
                    config.num_nextn_predict_layers)
        model.mtp = torch.nn.ModuleList()
        model.mtp_available = False
        params = dict(model.named_parameters())
    for pname, p in params.items():
        if pname == "lm_head.weight" and config.tie_word_embeddings and pname not in covered:
            continue
        if pname.endswith(_OPTIONAL) and pname not in covered:
            continue  # a LayerNorm without bias: keep the zero bias
        stacked = re.search(r"experts\.w[123](_packed|_scale)?$", pname) is not None
        got = covered.get(pname, set())
        if stacked and None not in got:
            missing = sorted(set(range(p.shape[0])) - got)
            if missing:
                raise CheckpointError(f"missing tensor for expert {missing[0]} of {_ckpt_hint(pname)}")
        elif not got:
            what = "MTP layer is partly present; missing" if pname.startswith("mtp.") else "missing tensor"
            raise CheckpointError(f"{what} {_ckpt_hint(pname)} (parameter {pname}, shape {list(p.shape)})")


def _ckpt_hint(pname: str) -> str:
    """A checkpoint-style name for an internal parameter, for error messages."""
    return "model." + pname.replace(".ffn.", ".mlp/block_sparse_moe.").replace("_res.proj.", "_res_proj.") \
        .replace("_res.norm.", "_res_norm.")


def _cast(model: CausalLM, dtype: torch.dtype) -> None:
    for name, p in model.named_parameters():
        want = torch.float32 if name.endswith(FP32_PARAMS) else dtype
        if p.dtype != want:
            p.data = p.data.to(want)
