"""Load a checkpoint folder (config.json + model.safetensors or a sharded index) into a model.

Every parameter must be filled exactly once from a tensor of the right shape: a missing, unexpected or mis-shaped
tensor is a CheckpointError naming it (and both shapes). Never unpickles anything: safetensors and JSON only.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError
from .base import CausalLM
from .registry import model_class
from ..ops.mx import dequant_mxfp4
from .weights import canonical, targets

log = logging.getLogger(__name__)

# Parameters kept in fp32 whatever the model dtype (model.md §14.3, §15.1).
FP32_PARAMS = ("A_log", "dt_bias", "_conv1d.weight", "e_score_correction_bias")
# Parameters a checkpoint may omit, with the value used instead.
_OPTIONAL = ("indexer.k_norm.bias",)
_PROGRESS_MIN_BYTES = 256 << 20

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


def load_model(path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> CausalLM:
    """Build the family's model from a checkpoint folder and fill every parameter from its safetensors."""
    path = Path(path)
    torch_dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if torch_dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"unsupported dtype {dtype!r}; use float32 or bfloat16")
    raw = read_config(path)
    files = tensor_files(path)
    shapes = tensor_shapes(files)
    config = ModelConfig.from_dict(raw, tensor_shapes=shapes)
    with torch.device(device):
        model = model_class(config)(config)
    params = dict(model.named_parameters())
    plan, mtp_seen = _plan(config, shapes, params)
    _check_coverage(config, model, params, plan, mtp_seen)

    total = sum(_nbytes(shapes[n], 2) for n in shapes)
    bar = tqdm(total=len(plan), desc="Loading weights", unit="tensor", disable=total < _PROGRESS_MIN_BYTES)
    pending_mx: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    handles: dict[Path, object] = {}
    try:
        with torch.no_grad():
            for name, tgts in plan.items():
                f = files[name]
                if f not in handles:
                    handles[f] = safe_open(f, "pt", device="cpu").__enter__()
                tensor = handles[f].get_tensor(name)
                for t in tgts:
                    value = t.convert(tensor) if t.convert else tensor
                    if t.fmt != "dense":
                        pending_mx.setdefault((t.param, t.expert), {})[t.fmt] = value
                        parts = pending_mx[(t.param, t.expert)]
                        if len(parts) < 2:
                            continue
                        value = dequant_mxfp4(parts["mxfp4_packed"], parts["mxfp4_scale"])
                        del pending_mx[(t.param, t.expert)]
                    dest = params[t.param] if t.expert is None else params[t.param][t.expert]
                    if tuple(value.shape) != tuple(dest.shape):
                        raise CheckpointError(f"tensor {name!r} has shape {list(value.shape)} but the config "
                                              f"implies {list(dest.shape)}")
                    dest.copy_(value)
                bar.update(1)
    finally:
        bar.close()
        for h in handles.values():
            h.__exit__(None, None, None)
    if pending_mx:
        (param, expert), parts = next(iter(pending_mx.items()))
        raise CheckpointError(f"MXFP4 expert {expert} of {param} lacks its {'scale' if 'mxfp4_packed' in parts else 'packed'} tensor")
    if config.tie_word_embeddings and not any(t.param == "lm_head.weight" for ts in plan.values() for t in ts):
        model.lm_head.weight = model.embed_tokens.weight
    _cast(model, torch_dtype)
    model.requires_grad_(False)
    model.eval()
    return model


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
    vision = [n for n in shapes if n.startswith(("vision_tower.", "mm_projector."))]
    if vision:
        log.warning("skipping %d vision tensors: vision input is not supported yet", len(vision))
    return plan, mtp_seen


def _check_coverage(config: ModelConfig, model: CausalLM, params: dict, plan: dict, mtp_seen: set[int]) -> None:
    """Every parameter (and every expert row of stacked experts) must be provided; MTP all or nothing."""
    covered: dict[str, set] = defaultdict(set)
    names_for: dict[tuple[str, int | None], str] = {}
    for name, tgts in plan.items():
        for t in tgts:
            key = (t.param, t.expert)
            if t.fmt != "mxfp4_scale":
                if key in names_for and t.fmt == "dense":
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
        stacked = pname.endswith(("experts.w1", "experts.w2", "experts.w3"))
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
