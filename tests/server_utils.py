"""Helpers for tests/test_server.py: a real `deltaserve serve` subprocess on a free port, its engine-core child, and a
small SSE reader for raw httpx streams."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    api_key: str | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def children(self) -> list[int]:
        return child_pids(self.proc.pid)

    def engine_pid(self) -> int:
        """The engine-core process: the one live child of the server's multiprocessing fork server (the resource
        tracker is the server's other child)."""
        servers = [p for p in self.children() if "forkserver" in cmdline(p)]
        pids = [c for f in servers for c in child_pids(f) if pid_alive(c)]
        assert len(pids) == 1, f"expected one engine core under the fork server {servers}, found {pids}"
        return pids[0]


def child_pids(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(x) for x in (task / "children").read_text().split()]
    return sorted(set(out))


def descendants(pid: int) -> list[int]:
    """Children, grandchildren, ... of `pid` (the engine core is the fork server's child)."""
    out: list[int] = []
    todo = child_pids(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += child_pids(p)
    return sorted(set(out))


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an exited process not yet reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(pred, timeout: float, interval: float = 0.05):
    """Poll `pred` until it returns a truthy value (returned) or `timeout` passes (the last value is returned)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def _stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def run_server(model: str | Path | None, *args: str, api_key: str | None = None,
               timeout: float = START_TIMEOUT_S) -> Iterator[Server]:
    """Start `deltaserve serve MODEL --port P ARGS...` (no MODEL for None: the embedded default model), wait for
    /health 200, yield a Server; always stop it (SIGTERM, then SIGKILL) and any engine child it leaves behind."""
    port = free_port()
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", *([] if model is None else [str(model)]), "--port",
           str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    log = tempfile.NamedTemporaryFile(prefix="deltaserve-test-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, Path(log.name), api_key)
    children: list[int] = []
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} during start-up:\n{server.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{server.log()}")
            time.sleep(0.1)
        children = descendants(proc.pid)
        yield server
    finally:
        children = sorted(set(children) | set(descendants(proc.pid)))
        _stop(proc)
        for pid in children:  # an engine core the server failed to stop (it also exits when its parent is gone)
            if pid_alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


# ------------------------------------------------------------------------------------------------ checks
def integrity(server) -> dict:
    r = httpx.get(server.url + "/debug/integrity", headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def all_free(server) -> dict | None:
    """The integrity report when the pools are intact and every page and slot is free, else None."""
    rep = integrity(server)
    ok = rep["ok"] and rep["free_pages"] == rep["total_pages"] and rep["free_slots"] == rep["total_slots"]
    return rep if ok else None


def assert_all_free(server, timeout: float = 5.0) -> None:
    rep = wait_until(lambda: all_free(server), timeout, 0.1)
    assert rep, f"pool not intact / not all free after {timeout} s: {integrity(server)}"
    assert rep["total_pages"] > 0 and rep["total_slots"] > 0, rep


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text
    m = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics:\n{text[:2000]}"
    return float(m.group(1))


# ------------------------------------------------------------------------------------------------ SSE
def iter_sse(response: httpx.Response) -> Iterator[dict | str]:
    """The `data:` payloads of a streamed response: dicts, and the string "[DONE]"."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        yield payload if payload == "[DONE]" else json.loads(payload)
