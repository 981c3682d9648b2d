"""The only module that reads environment variables."""

import os
from pathlib import Path


def log_level() -> str:
    """DELTASERVE_LOG_LEVEL: the logging level of the CLI, the server and the engine process (default INFO: progress
    while loading, the server's start-up banner and its access log; WARNING keeps only problems)."""
    return os.environ.get("DELTASERVE_LOG_LEVEL", "INFO").upper()


def cache_dir() -> Path:
    """DELTASERVE_CACHE_DIR: where deltaserve keeps what it builds at run time (the native kernels); default
    $XDG_CACHE_HOME/deltaserve, else ~/.cache/deltaserve."""
    if "DELTASERVE_CACHE_DIR" in os.environ:
        return Path(os.environ["DELTASERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deltaserve"


def rendezvous() -> dict:
    """torchrun's rendezvous variables, the defaults of `--master-addr`, `--master-port` and `--node-rank`:
    MASTER_ADDR, MASTER_PORT and the node's rank (NODE_RANK, or torchrun's GROUP_RANK); absent ones are left out."""
    out: dict = {}
    if os.environ.get("MASTER_ADDR"):
        out["master_addr"] = os.environ["MASTER_ADDR"]
    if os.environ.get("MASTER_PORT"):
        out["master_port"] = int(os.environ["MASTER_PORT"])
    node = os.environ.get("NODE_RANK") or os.environ.get("GROUP_RANK")
    if node:
        out["node_rank"] = int(node)
    return out


def native_march() -> str:
    """DELTASERVE_NATIVE_MARCH: the CPU the native kernels are compiled for, as gcc's `-march` takes it (default
    `native`: this machine; `x86-64-v3` builds for any AVX2+FMA x86-64 CPU, as CI does). On ARM, `native` becomes
    `-mcpu=native`. A new value builds a new library (ops/native.py); one the CPU cannot run crashes on first use."""
    return os.environ.get("DELTASERVE_NATIVE_MARCH") or "native"
