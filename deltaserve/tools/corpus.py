"""Training corpus for the default model: the Python standard library's own source (code, comments, docstrings),
read from the interpreter that runs the script. Licence: Python Software Foundation License (PSF-2.0).

Deterministic: files are listed by path relative to the stdlib folder and sorted; which files are held out for
validation is decided by a hash of that relative path, so the split does not depend on the Python version. The
held-out text is written once into ``deltaserve/data/validation.txt`` and shipped, so tests measure on the same
text whatever Python is installed; training always skips held-out files (by relative path).
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
VALIDATION_PATH = DATA_DIR / "validation.txt"
FILE_SEP = "\n\n"  # between documents: two blank lines, as between top-level definitions

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "lib2to3"}
VAL_BUCKETS = 40  # a file is held out when hash(relative path) % VAL_BUCKETS == 0
VAL_MAX_BYTES = 300_000


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative posix path, absolute path) of every stdlib ``.py`` file outside tests and third-party folders."""
    root = root or stdlib_dir()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            continue
        out.append((rel.as_posix(), p))
    return sorted(out)


def is_validation(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % VAL_BUCKETS == 0


def _read(p: Path) -> str | None:
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text.replace("\r\n", "\n").strip("\n") + "\n"


def training_documents(root: Path | None = None) -> list[str]:
    """Training files' texts, in sorted path order (the held-out files are excluded)."""
    docs = []
    for rel, p in stdlib_files(root):
        if not is_validation(rel):
            text = _read(p)
            if text:
                docs.append(text)
    return docs


def build_validation_text(root: Path | None = None, max_bytes: int = VAL_MAX_BYTES) -> str:
    """Held-out files concatenated in path order, whole files only, up to ``max_bytes`` UTF-8 bytes."""
    parts, size = [], 0
    for rel, p in stdlib_files(root):
        if is_validation(rel):
            text = _read(p)
            if not text:
                continue
            n = len((text + FILE_SEP).encode())
            if size + n > max_bytes:
                continue
            parts.append(f"# {rel}\n{text}")
            size += n
    return FILE_SEP.join(parts)


def validation_text() -> str:
    """The shipped held-out text (``deltaserve/data/validation.txt``)."""
    return VALIDATION_PATH.read_text(encoding="utf-8")
