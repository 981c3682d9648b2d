"""The only module that reads environment variables."""

import os


def log_level() -> str:
    """DELTASERVE_LOG_LEVEL: the logging level of the CLI, the server and the engine process (default WARNING)."""
    return os.environ.get("DELTASERVE_LOG_LEVEL", "WARNING").upper()
