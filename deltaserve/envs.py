"""The only module that reads environment variables."""

import os
from pathlib import Path


def log_level() -> str:
    """DELTASERVE_LOG_LEVEL: the logging level of the CLI, the server and the engine process (default WARNING)."""
    return os.environ.get("DELTASERVE_LOG_LEVEL", "WARNING").upper()


def cache_dir() -> Path:
    """DELTASERVE_CACHE_DIR: where deltaserve keeps what it builds at run time (the native kernels); default
    $XDG_CACHE_HOME/deltaserve, else ~/.cache/deltaserve."""
    if "DELTASERVE_CACHE_DIR" in os.environ:
        return Path(os.environ["DELTASERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deltaserve"
