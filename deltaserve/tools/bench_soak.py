"""`deltaserve bench soak`: many clients against a real `deltaserve serve` for minutes, with preemption forced.

It starts the server itself (so it can read the API and engine processes' memory and the pools' integrity), then
runs `--clients` concurrent clients for `--duration` seconds. Each client loops over a seeded mix of what real
clients send: streamed chats, plain and `n=2` completions, stop strings, streams the client drops half-way, and
requests the server must refuse with a 400. The cache is kept small (`--kv-cache-memory`) so the scheduler has to
preempt. Afterwards the pools must be intact with every page and state slot free.

Reported: requests by kind, errors (an unexpected status, a stream without `[DONE]` that the client did not drop,
an error event, a timeout), preemptions, and the resident memory (API process + its children) sampled every few
seconds: the growth is measured from the end of `--warmup` seconds to the end of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .bench_report import emit, format_table, machine_info

_KINDS = ("chat_stream", "completion", "completion_n2", "stop_string", "dropped_stream", "bad_request")
_WEIGHTS = (35, 25, 10, 10, 10, 10)
_PROMPTS = ("def parse_args(argv):\n", "import os\n\n\ndef walk(path):\n", "class Cache:\n    def __init__(self",
            "# Read a CSV file and", "for i in range(10):\n", "with open(path) as f:\n")


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--clients", type=int, default=128, help="clients sending at once")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before the memory baseline is taken")
    p.add_argument("--kv-cache-memory", default="24MiB", help="small, so that the scheduler must preempt")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the server's --max-num-seqs")
    p.add_argument("--server-arg", action="append", default=[], help="extra `deltaserve serve` argument (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="seed of the clients' choices")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and its children."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
    return total


def _body(rng: random.Random, kind: str, model: str) -> tuple[str, dict]:
    prompt = rng.choice(_PROMPTS)
    if kind in ("chat_stream", "dropped_stream"):
        return "/v1/chat/completions", {
            "model": model, "stream": True, "max_tokens": rng.randint(16, 64), "temperature": rng.choice([0, 0.8]),
            "messages": [{"role": "user", "content": prompt}], "ignore_eos": True}
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(8, 48), "temperature": 0.7,
            "seed": rng.randint(0, 1 << 30)}
    if kind == "completion_n2":
        body["n"] = 2
    elif kind == "stop_string":
        body["stop"] = ["\n\n", "return"]
    elif kind == "bad_request":
        body["temperature"] = -1.0
    return "/v1/completions", body


async def _one(client: httpx.AsyncClient, rng: random.Random, kind: str, model: str) -> str | None:
    """Send one request of `kind`; returns None when it went as it should, else what went wrong."""
    path, body = _body(rng, kind, model)
    expect = 400 if kind == "bad_request" else 200
    if not body.get("stream"):
        r = await client.post(path, json=body)
        if r.status_code != expect:
            return f"{kind}: HTTP {r.status_code} {r.text[:160]!r}"
        err = r.json().get("error") if expect == 400 else None
        if expect == 400 and not (isinstance(err, dict) and err.get("code") == 400):
            return f"{kind}: not an OpenAI error body: {r.text[:160]!r}"
        return None
    drop_after = rng.randint(1, 8) if kind == "dropped_stream" else None
    chunks = 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return f"{kind}: HTTP {r.status_code} {(await r.aread())[:160]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return None
            if "error" in json.loads(line[6:]):
                return f"{kind}: error event {line[:200]}"
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return None  # leaving the block closes the connection: the server must abort the request
    return f"{kind}: stream ended without [DONE] after {chunks} chunks"


async def _client(base: str, model: str, seed: int, stop_at: float, counts: dict, errors: list) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while time.monotonic() < stop_at:
            kind = rng.choices(_KINDS, _WEIGHTS)[0]
            try:
                problem = await _one(client, rng, kind, model)
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                problem = f"{kind}: {type(e).__name__}: {e}"
            counts[kind] = counts.get(kind, 0) + 1
            if problem is not None:
                errors.append(problem)


async def _load(base: str, model: str, args: argparse.Namespace, pid: int) -> tuple[dict, list, list]:
    start = time.monotonic()
    stop_at = start + args.duration
    counts: dict = {}
    errors: list = []
    samples: list[tuple[float, int]] = []
    tasks = [asyncio.create_task(_client(base, model, args.seed * 100_003 + i, stop_at, counts, errors))
             for i in range(args.clients)]
    while not all(t.done() for t in tasks):
        samples.append((time.monotonic() - start, _tree_rss(pid)))
        await asyncio.wait(tasks, timeout=5.0)
    for t in tasks:
        t.result()
    samples.append((time.monotonic() - start, _tree_rss(pid)))
    return counts, errors, samples


def _wait_all_free(base: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        rep = httpx.get(base + "/debug/integrity", timeout=30).json()
        free = rep["ok"] and rep["free_pages"] == rep["total_pages"] and rep["free_slots"] == rep["total_slots"]
        if free or time.monotonic() > deadline:
            return {**rep, "all_free": free}
        time.sleep(0.5)


def run_soak(args: argparse.Namespace) -> str:
    from ..default_model import default_model_path

    model_dir = Path(args.model) if args.model else default_model_path()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", str(model_dir), "--port", str(port),
           "--served-model-name", "soak", "--kv-cache-memory", args.kv_cache_memory,
           "--max-num-seqs", str(args.max_num_seqs), *args.server_arg]
    with tempfile.NamedTemporaryFile(prefix="deltaserve-soak-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited during start-up; see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become healthy; see {log.name}")
            time.sleep(0.2)
        counts, errors, samples = asyncio.run(_load(base, "soak", args, proc.pid))
        integrity = _wait_all_free(base)
        server_alive = proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    log_text = Path(log.name).read_text(errors="replace")
    baseline = next((rss for t, rss in samples if t >= args.warmup), samples[0][1])
    end_rss = samples[-1][1]
    result = {"requests": sum(counts.values()), "by_kind": counts, "errors": len(errors),
              "sample_errors": errors[:5], "preemptions": integrity.get("stats", {}).get("num_preemptions"),
              "integrity_ok": integrity["ok"], "all_free_after": integrity["all_free"],
              "server_alive": server_alive, "tracebacks_in_log": log_text.count("Traceback"),
              "rss_baseline_mb": baseline / 2 ** 20, "rss_end_mb": end_rss / 2 ** 20,
              "rss_max_mb": max(r for _, r in samples) / 2 ** 20,
              "rss_growth_pct": 100.0 * (end_rss - baseline) / baseline, "log": log.name}
    config = {k: getattr(args, k) for k in ("clients", "duration", "warmup", "kv_cache_memory", "max_num_seqs",
                                            "server_arg", "seed")}
    config["model"] = str(model_dir)
    payload = {"bench": "soak", "config": config, "machine": machine_info(), "result": result,
               "rss_samples": samples}
    rows = [[k, v] for k, v in result.items() if k not in ("by_kind", "sample_errors")]
    rows += [[f"requests: {k}", v] for k, v in sorted(counts.items())]
    table = "soak  " + " ".join(f"{k}={v}" for k, v in config.items()) + "\n" + format_table(["figure", "value"], rows)
    if errors:
        table += "\nfirst errors: " + " | ".join(errors[:5])
    return emit(args, payload, table, None)
