"""`deltaserve quantize IN OUT --scheme ...`: write a checkpoint whose target layers are stored in MX formats in the
compressed-tensors layout, with the `quantization_config` that makes `load_model` / `serve` run them without flags.

Per target layer `X` (which layers: layers/quantized.py):
  MXFP8 (dense part):  X.weight float8_e4m3fn [N, K]   + X.weight_scale uint8 [N, K/32]   format "mxfp8-quantized"
  MXFP4 (experts):     X.weight_packed uint8 [N, K/2]  + X.weight_scale uint8 [N, K/32]   format "mxfp4-pack-quantized"
Weight scales use the spec's FLOOR rule. Every other tensor, and tensors the input already stores quantised (e.g. the
K3 release's MXFP4 experts), is copied as it is; an existing config group is kept and, where the scheme adds
activation quantisation to it, updated. Shards keep their file names; tokenizer and other files are copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..errors import CheckpointError, ConfigError
from ..layers.quantized import (EXPERT_NAME, MXScheme, Quantization, ct_group, get_scheme, is_dense_target, quantization_config_of,
                                stored_schemes)
from ..models.loader import read_config, tensor_files
from ..models.weights import canonical
from ..ops.mx import quantize_mx

_EXPERT_TARGET = r"re:.*\.experts\.\d+\.(w[123]|gate_proj|up_proj|down_proj)$"


def quantize_checkpoint(src: str | Path, dst: str | Path, scheme: str, progress: bool = True) -> Path:
    """Write `src` quantised with `scheme` ("w8a8-mxfp8", "w4a8-mxfp4" or "mxfp") into folder `dst`."""
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ConfigError("quantize: OUT must differ from IN")
    q = get_scheme(scheme)
    raw = read_config(src)
    stored = stored_schemes(quantization_config_of(raw))
    files = tensor_files(src)
    dst.mkdir(parents=True, exist_ok=True)
    dense_leaves: set[str] = set()
    experts_done = False
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    bar = tqdm(total=len(files), desc=f"Quantizing ({scheme})", unit="tensor", disable=not progress)
    for f, names in by_file.items():
        out: dict[str, torch.Tensor] = {}
        with safe_open(f, "pt") as sf:
            for name in sorted(names):
                t = sf.get_tensor(name)
                kind = _kind(name, t, q.dense is not None, q.experts is not None)
                if kind == "dense":
                    _write_mx(out, name, t, q.dense)
                    dense_leaves.add(".".join(name.split(".")[-3:-1]))
                elif kind == "expert":
                    _write_mx(out, name, t, q.experts)
                    experts_done = True
                else:
                    out[name] = t
                bar.update(1)
        save_file(out, dst / f.name, metadata={"format": "pt"})
        weight_map.update({n: f.name for n in out})
        total_bytes += sum(t.numel() * t.element_size() for t in out.values())
    bar.close()
    if q.experts is not None and not experts_done and "mxfp4-pack-quantized" not in stored:
        raise CheckpointError(f"{src}: scheme {scheme!r} quantises routed experts, but the checkpoint has none "
                              f"stored per expert (fused expert tensors are not supported)")
    if (src / "model.safetensors.index.json").is_file():
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _write_config(raw, dst, q, stored, sorted(dense_leaves), experts_done)
    for extra in src.iterdir():
        if extra.is_file() and extra.name != "config.json" and not extra.name.startswith("model"):
            shutil.copy2(extra, dst / extra.name)
    return dst


def _kind(name: str, t: torch.Tensor, dense: bool, experts: bool) -> str:
    """"dense" or "expert" for a bf16/fp32 weight the scheme quantises, else "copy"."""
    canon = canonical(name)
    if canon is None or not canon.endswith(".weight") or t.ndim != 2 or not t.is_floating_point() \
            or t.element_size() == 1:
        return "copy"
    path = canon[: -len(".weight")]
    if EXPERT_NAME.match(path):
        return "expert" if experts else "copy"
    return "dense" if dense and is_dense_target(path, t.shape[1]) else "copy"


def _write_mx(out: dict, name: str, t: torch.Tensor, scheme: MXScheme) -> None:
    base = name[: -len("weight")]
    qd = quantize_mx(t.float(), scheme.weight)
    out[base + ("weight_packed" if scheme.ct_format == "mxfp4-pack-quantized" else "weight")] = qd.data
    out[base + "weight_scale"] = qd.scale


def _write_config(raw: dict, dst: Path, q: Quantization, stored: dict[str, MXScheme], dense_leaves: list[str],
                  experts_done: bool) -> None:
    """config.json with a compressed-tensors `quantization_config` describing every MX group of the output."""
    old = quantization_config_of(raw) or {}
    groups = {}
    for gname, group in (old.get("config_groups") or {}).items():
        fmt = group.get("format") or old.get("format")
        if fmt == "mxfp4-pack-quantized" and q.experts is not None:
            group = ct_group(q.experts, group.get("targets", [_EXPERT_TARGET]))  # now also A8
        groups[gname] = group
    if dense_leaves:
        escaped = [leaf.replace(".", "\\.") for leaf in dense_leaves]
        groups[f"group_{len(groups)}"] = ct_group(q.dense, [f"re:.*\\.{leaf}$" for leaf in escaped])
    if experts_done:
        groups[f"group_{len(groups)}"] = ct_group(q.experts, [_EXPERT_TARGET])
    formats = {g["format"] for g in groups.values()}
    qc = {"quant_method": "compressed-tensors", "quantization_status": "compressed",
          "format": formats.pop() if len(formats) == 1 else "mixed-precision", "config_groups": groups,
          "ignore": ["lm_head"]}
    target = raw["text_config"] if "text_config" in raw else raw
    target["quantization_config"] = qc
    if target is not raw:
        raw.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
