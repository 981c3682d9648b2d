"""The only module that reads environment variables (cache folder and log level)."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Folder for files deltaserve writes once and reuses (e.g. the default model)."""
    root = os.environ.get("DELTASERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "deltaserve"
    )
    return Path(root)


def log_level() -> str:
    return os.environ.get("DELTASERVE_LOG_LEVEL", "WARNING").upper()
