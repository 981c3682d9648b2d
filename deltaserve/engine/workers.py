"""Tensor-parallel worker processes (docs/parallel.md §5): the engine process is rank 0 of a torch.distributed group
(gloo on CPU) and starts ranks 1 .. N-1 on this machine; every rank holds its shard of the model and its own pools.

Rank 0 alone schedules. Before each forward it broadcasts one `StepLayout` (engine/runner.py) as int64 tensors —
a fixed header, then the body the header sizes; never pickle — together with the journal of its pools' data
changes since the last step (slots zeroed or copied, pages copied: cache/state_slots.py), which each worker replays
in order before running the same step; every collective inside the forward (the layers' all-reduces, the logits'
gather) then pairs up rank by rank. With MTP drafting (spec_decode/mtp.py) rank 0 also sends each run of an MTP
layer j the same way, as a header of kind DRAFT + j, the layout of the layer's rows, and the states they read one
position back (one float tensor), so that every rank runs that layer's shard too. A header of kind STOP ends the workers.

Failure: a step's collective that does not complete within `distributed_timeout` seconds raises on every rank still
there; rank 0 then fails its requests and the engine stops (EngineCore); a worker whose peer is gone exits. Start-up
(joining, loading the shards) may take up to STARTUP_TIMEOUT_S."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..backends.select import select_backend
from ..cache.paged_cache import PagedCache
from ..cache.state_slots import COPY, COPY_BLOCK, ZERO
from ..distributed import CommClock, Shard
from ..errors import ConfigError
from ..layers.batch import DraftSlot, StepLayout
from ..models.loader import DTYPES, load_config, load_model
from ..spec_decode import MTPProposer
from .config import EngineArgs, resolve_dtype
from .pools import PoolSizes, build_pools, drafter_cache_layers, pool_bytes
from .runner import ModelRunner
from .summary import weight_bytes

log = logging.getLogger(__name__)

STEP, STOP, DRAFT = 1, 0, 2
HEADER = 8  # kind, rows, sequences, table entries, snapshots, sample rows, scorings, journal entries
STARTUP_TIMEOUT_S = 600  # loading a large checkpoint's shard takes minutes
JOURNAL_WIDTH = 5  # the longest journal entry, COPY's; shorter ones are padded with -1


def encode(layout: StepLayout, journal: list[tuple[int, ...]], kind: int = STEP) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's header and body."""
    snaps = [(i, off, int(isinstance(t, DraftSlot)), t.slot if isinstance(t, DraftSlot) else t)
             for i, seq in enumerate(layout.snapshots) for off, t in seq]
    body = [*layout.ids, *layout.positions, *layout.query_start, *layout.context_lens, *layout.slots,
            *(len(t) for t in layout.tables), *(b for t in layout.tables for b in t), *(v for s in snaps for v in s),
            *layout.sample_rows, *(v for r in layout.score_rows for v in r),
            *(v for entry in journal for v in (*entry, *[-1] * (JOURNAL_WIDTH - len(entry))))]
    header = [kind, len(layout.ids), len(layout.slots), sum(map(len, layout.tables)), len(snaps),
              len(layout.sample_rows), len(layout.score_rows), len(journal)]
    return torch.tensor(header, dtype=torch.int64), torch.tensor(body, dtype=torch.int64)


def decode(header: torch.Tensor, body: torch.Tensor) -> tuple[StepLayout, list[tuple[int, ...]]]:
    """The layout and journal `encode` wrote."""
    _, N, B, T, S, R, C, J = header.tolist()
    values = iter(body.tolist())

    def take(n: int) -> list[int]:
        return [next(values) for _ in range(n)]

    ids, positions, query_start, context_lens, slots = take(N), take(N), take(B + 1), take(B), take(B)
    lengths = take(B)
    flat = take(T)
    tables, at = [], 0
    for n in lengths:
        tables.append(flat[at:at + n])
        at += n
    snapshots: list[list] = [[] for _ in range(B)]
    for _ in range(S):
        seq, off, draft, slot = take(4)
        snapshots[seq].append((off, DraftSlot(slot) if draft else slot))
    sample_rows = take(R)
    score_rows = [tuple(take(2)) for _ in range(C)]
    journal = [tuple(v for v in take(JOURNAL_WIDTH) if v != -1) for _ in range(J)]
    return StepLayout(ids, positions, query_start, context_lens, slots, tables, snapshots, sample_rows,
                      score_rows), journal


def replay(journal: list[tuple[int, ...]], cache: PagedCache) -> None:
    """Apply rank 0's pool changes to this rank's pools, in order."""
    pools = [cache.states, cache.checkpoints, cache.drafts]
    for entry in journal:
        if entry[0] == ZERO:
            pools[entry[1]].zero(entry[2])
        elif entry[0] == COPY:
            pools[entry[1]].copy_to(entry[2], pools[entry[3]], entry[4])
        elif entry[0] == COPY_BLOCK:
            cache.pages.copy_block(entry[1], entry[2])
        else:
            raise ValueError(f"unknown journal entry {entry}")


class Workers:
    """Rank 0's side: the worker processes of one engine (`python -m deltaserve.engine.rank`, each given its rank and
    the engine's arguments as JSON) and the journal rank 0's pools write to."""

    def __init__(self, args: EngineArgs, model_path: Path):
        if dist.is_initialized():  # torch.distributed has one default group a process
            raise ConfigError("this process already runs a tensor-parallel engine (or another torch.distributed "
                              "group); close it first")
        self.world = args.tensor_parallel_size
        self.journal: list[tuple[int, ...]] = []
        self.closed = False
        _share_cores(args)
        port = args.master_port or _free_port()
        self.processes = start_ranks(args, model_path, port, first=1)
        try:
            self.group = _init_groups(0, self.world, args.master_addr, port, args.distributed_timeout)
        except Exception:
            self.close()
            raise
        self.clock = CommClock()  # rank 0's collectives: the step broadcasts and the layers' own
        self.shard = Shard(0, self.world, args.enable_expert_parallel, self.group, clock=self.clock)
        self.rank_bytes: list[tuple[int, int]] = []  # per rank: (weight bytes, pool bytes)
        log.info("tensor parallel over %d ranks (gloo; expert parallel: %s); workers %s", self.world,
                 args.enable_expert_parallel, [p.pid for p in self.processes])

    def share_pools(self, sizes: list[int], weight_bytes: int, pool_bytes: int) -> None:
        """Send rank 0's pool sizes (every rank builds the same pools), then gather every rank's weight and pool
        bytes (`rank_bytes`, logged)."""
        dist.broadcast(torch.tensor(sizes, dtype=torch.int64), src=0)
        self.rank_bytes = _gather_bytes(weight_bytes, pool_bytes, self.world)
        for rank, (weights, pools) in enumerate(self.rank_bytes):
            log.info("rank %d: %d weight bytes, %d cache pool bytes", rank, weights, pools)

    def send_step(self, layout: StepLayout) -> None:
        header, body = encode(layout, self.journal)
        self.journal.clear()
        started = time.perf_counter()
        dist.broadcast(header, src=0, group=self.group)
        dist.broadcast(body, src=0, group=self.group)
        self.clock.add(started)

    def send_draft(self, layout: StepLayout, hidden: torch.Tensor, layer: int) -> None:
        """A run of MTP layer `layer` (header kind DRAFT + layer): its rows' layout and the states [rows, d] they
        read one position back."""
        header, body = encode(layout, self.journal, DRAFT + layer)
        self.journal.clear()
        started = time.perf_counter()
        dist.broadcast(header, src=0, group=self.group)
        dist.broadcast(body, src=0, group=self.group)
        dist.broadcast(hidden.float().contiguous(), src=0, group=self.group)
        self.clock.add(started)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.processes)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers: a STOP header while they all answer, else (a rank gone or hung) kill them; wait. Once:
        later calls (the engine's finalizer) do nothing."""
        if self.closed:
            return
        self.closed = True
        stopped = False
        if dist.is_initialized():
            if self.alive():
                try:
                    dist.broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64), src=0,
                                   group=self.group)
                    stopped = True
                except RuntimeError:
                    log.warning("the workers did not take the stop message; killing them")
            dist.destroy_process_group()
        for p in self.processes:
            if not stopped:
                p.kill()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_ranks(args: EngineArgs, model_path: Path, port: int, first: int) -> list[subprocess.Popen]:
    """Start this node's ranks from `first` on (`tensor_parallel_size / nnodes` ranks a node)."""
    per_node = args.tensor_parallel_size // args.nnodes
    spec = json.dumps({"args": dataclasses.asdict(args), "model": str(model_path), "port": port})
    return [subprocess.Popen([sys.executable, "-m", "deltaserve.engine.rank", str(rank), spec])
            for rank in range(max(first, args.node_rank * per_node), (args.node_rank + 1) * per_node)]


def run_worker_node(args: EngineArgs, model_path: Path) -> int:
    """A node other than 0 (`--node-rank` > 0): its ranks, until they end (rank 0 stops them, or is gone); the
    highest exit status."""
    processes = start_ranks(args, model_path, args.master_port, first=0)
    log.info("node %d of %d: %d ranks (pids %s) meet at %s:%d", args.node_rank, args.nnodes, len(processes),
             [p.pid for p in processes], args.master_addr, args.master_port)
    return max(p.wait() for p in processes)


def worker_main(rank: int, args: EngineArgs, model_path: str, port: int) -> None:
    """Rank `rank`: its shard, pools of rank 0's sizes, then steps until STOP or a failed collective (rank 0 gone:
    at the latest after distributed_timeout)."""
    _share_cores(args)
    group = _init_groups(rank, args.tensor_parallel_size, args.master_addr, port, args.distributed_timeout)
    try:
        shard = Shard(rank, args.tensor_parallel_size, args.enable_expert_parallel, group)
        dtype = resolve_dtype(args.dtype, load_config(model_path).torch_dtype).name
        model = load_model(model_path, dtype=dtype, quantization=args.quantization, shard=shard)
        sizes = torch.empty(len(PoolSizes._fields), dtype=torch.int64)
        dist.broadcast(sizes, src=0)
        spec = args.speculative
        pools = build_pools(model.config, args, DTYPES[dtype], PoolSizes(*sizes.tolist()),
                            drafter_cache_layers(model.config, spec), shard)
        _gather_bytes(weight_bytes(model), pool_bytes(*pools), args.tensor_parallel_size)
        cache = PagedCache(*pools)
        backend = select_backend(args.backend, args.ops)
        backend.prepare(model)
        runner = ModelRunner(model, cache, backend)
        mtp = MTPProposer(model, cache, backend) if spec is not None and spec.method == "mtp" else None
        header = torch.empty(HEADER, dtype=torch.int64)
        while True:
            dist.broadcast(header, src=0, group=group)
            if int(header[0]) == STOP:
                return
            body = torch.empty(_body_length(header), dtype=torch.int64)
            dist.broadcast(body, src=0, group=group)
            layout, journal = decode(header, body)
            replay(journal, cache)
            if int(header[0]) >= DRAFT:
                hidden = torch.empty(len(layout.ids), model.config.hidden_size)
                dist.broadcast(hidden, src=0, group=group)
                mtp.run_layout(layout, hidden, int(header[0]) - DRAFT)
            else:
                runner.run_layout(layout)
    except RuntimeError as exc:  # rank 0 or a peer is gone (a collective failed or timed out)
        log.error("tensor-parallel rank %d stops: %s", rank, exc)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _share_cores(args: EngineArgs) -> None:
    """This node's ranks split its cores: each takes its share of the threads torch would use alone."""
    per_node = args.tensor_parallel_size // args.nnodes
    torch.set_num_threads(max(1, torch.get_num_threads() // per_node))


class RanksOutOfStep(RuntimeError):
    """A tensor-parallel step failed while the ranks were running it: some may have gone past a collective others
    never reached, so none can run another step."""


def _gather_bytes(weights: int, pools: int, world: int) -> list[tuple[int, int]]:
    mine = torch.tensor([weights, pools], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [(int(t[0]), int(t[1])) for t in every]


def _body_length(header: torch.Tensor) -> int:
    _, N, B, T, S, R, C, J = header.tolist()
    return 2 * N + (B + 1) + 3 * B + T + 4 * S + R + 2 * C + JOURNAL_WIDTH * J


def _init_groups(rank: int, world: int, addr: str, port: int, step_timeout_s: float):
    """Join the ranks: the default group, whose start-up collectives (the rendezvous, the pool sizes rank 0 sends
    once it has loaded its weights, the bytes report) wait up to STARTUP_TIMEOUT_S, and the group the steps run on,
    whose collectives wait `step_timeout_s` (--distributed-timeout). Returns the step group."""
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=max(STARTUP_TIMEOUT_S, step_timeout_s)))
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=step_timeout_s))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

