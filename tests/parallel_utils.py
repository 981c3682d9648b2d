"""Worker processes for the tensor-parallel tests: gloo ranks on this machine, each loading its shard of a checkpoint
and writing what rank 0 of each group computed to a safetensors file (never pickle)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from deltaserve.distributed import Shard
from deltaserve.models.loader import load_model
from server_utils import free_port

# (ranks a group, expert parallel): every layout a world of 4 ranks runs, groups of 2 side by side
LAYOUTS = [(2, False), (2, True), (4, False), (4, True)]


def _rank_main(rank: int, world: int, port: int, path: str, prompt: list[int], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    try:
        for size, ep in LAYOUTS:
            group, local = (None, rank) if size == world else (pairs[rank // 2], rank % 2)
            model = load_model(path, "float32", shard=Shard(local, size, ep, group))
            logits = model.reference_logits(torch.tensor(prompt))
            if local == 0:
                name = f"tp{size}-ep{int(ep)}-g{rank // size}.safetensors"
                save_file({"logits": logits.contiguous()}, Path(out) / name)
    finally:
        dist.destroy_process_group()


def sharded_logits(path: Path, prompt: list[int], out: Path, world: int = 4) -> dict[str, torch.Tensor]:
    """Every LAYOUTS entry's logits of `prompt` over a world of `world` gloo processes, by file name."""
    mp.start_processes(_rank_main, args=(world, free_port(), str(path), prompt, str(out)), nprocs=world,
                       start_method="spawn")
    return {f.stem: load_file(f)["logits"] for f in sorted(out.glob("*.safetensors"))}
