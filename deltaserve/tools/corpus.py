"""Training corpus for the default model: Python source written by people, read from the interpreter that runs the
script: the standard library (code, comments, docstrings; PSF-2.0) and the pure-Python part of the permissively
licensed packages in `PACKAGES`, which the project's own environment installs (pip, setuptools and the server's
dependencies). The "extended" corpus adds `EXTRA_PACKAGES`, more permissively licensed Python the environment
installs (torch's dependencies, the test and benchmark tools'), their own test suites included, each capped at
`EXTRA_MAX_BYTES`: nearly three times the core's text in all, so a longer run sees fresh text instead of repeating
itself, and tests written the way CPython's held-out ones are. Generated tables (the code-page codecs, Sphinx's
pydoc topics, HTML entities, Unicode and IDNA data, locale aliases) are left out: they are data, not code, and a
small model spends itself learning them.

Deterministic: files are listed by path (stdlib files relative to the stdlib folder, package files as
``site-packages/<distribution>/<path>``) and sorted; which files are held out is decided by a hash of that path, so
the split does not depend on the Python version. The held-out text of the standard library is written once into
``deltaserve/data/validation.txt`` and shipped, so tests measure on the same text whatever Python is installed;
training always skips held-out files (by path). A second held-out set, ``deltaserve/data/cpython_tests.txt``, is
taken from CPython's own test suite, which the corpus never includes. `manifest()` records each package's version,
licence and size.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import sysconfig
import tokenize
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
VALIDATION_PATH = DATA_DIR / "validation.txt"
TEST_SUITE_PATH = DATA_DIR / "cpython_tests.txt"
FILE_SEP = "\n\n"  # between documents: two blank lines, as between top-level definitions

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "testing", "idle_test", "lib2to3",
              "_vendor", "vendor", "vendored"}
VAL_BUCKETS = 40  # a file is held out when hash(path) % VAL_BUCKETS == 0
VAL_MAX_BYTES = 300_000
TEST_SUITE_BUCKETS = 16  # a CPython test-suite file joins the second held-out set when hash(path) % 16 == 0
TEST_SUITE_MAX_BYTES = 150_000

# Pure-Python packages installed with the project (its runtime dependencies and theirs, and the venv's pip and
# setuptools), each under a licence in ALLOWED_LICENCES; vendored copies of other projects (`_vendor`) are skipped.
PACKAGES = ("pip", "setuptools", "jinja2", "markupsafe", "fastapi", "starlette", "pydantic", "annotated-types",
            "typing_extensions", "anyio", "idna", "uvicorn", "click", "h11", "jsonschema", "referencing", "attrs",
            "prometheus_client")
# Installed with the project too (torch's dependencies, the test and benchmark tools' and theirs), read by the extended
# corpus only, with their tests; `make install` puts each in the environment, so the corpus is rebuilt the same way.
EXTRA_PACKAGES = ("sympy", "mpmath", "networkx", "pandas", "scikit-learn", "scipy", "joblib", "pytest", "packaging",
                  "httpx", "httpcore", "urllib3", "requests", "rich", "pygments", "fsspec", "filelock",
                  "huggingface_hub", "pyyaml", "python-dateutil")
EXTRA_MAX_BYTES = 3_000_000  # per extra package: whole files in sha1(path) order, so each spreads over the package
CORPORA = ("core", "extended")
# SPDX identifiers and the trove classifiers' names of the same licences
ALLOWED_LICENCES = {"MIT", "BSD-2-Clause", "BSD-3-Clause", "Apache-2.0", "PSF-2.0", "ISC", "MIT License",
                    "BSD License", "Apache Software License", "Python Software Foundation License"}
TABLE_MIN_BYTES = 4096
TABLE_LITERAL_SHARE = 0.6  # tables: most tokens are literals (code: 0.05-0.25, the codecs 0.73-0.91)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _listed(root: Path, prefix: str = "") -> list[tuple[str, Path]]:
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if not any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            out.append((prefix + rel.as_posix(), p))
    return out


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative posix path, absolute path) of every stdlib ``.py`` file outside tests and third-party folders."""
    return sorted(_listed(root or stdlib_dir()))


def package_licence(name: str) -> str:
    """The licence of installed distribution `name` (its SPDX expression, else its trove classifiers); ValueError
    unless every part is in ALLOWED_LICENCES."""
    meta = importlib.metadata.distribution(name).metadata
    expression = meta.get("License-Expression")
    if expression:
        parts = [p.strip("() ") for p in expression.replace(" OR ", " AND ").split(" AND ")]
    else:
        parts = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if not parts or any(p not in ALLOWED_LICENCES for p in parts):
        raise ValueError(f"corpus: {name}'s licence {expression or parts} is not one the corpus takes")
    return expression or " AND ".join(parts)


def package_files(name: str, with_tests: bool = False) -> list[tuple[str, Path]]:
    """(``site-packages/<name>/<path>``, absolute path) of the ``.py`` files installed distribution `name` owns,
    outside vendored folders, and outside test folders unless `with_tests`."""
    skip = _SKIP_DIRS - {"test", "tests", "testing"} if with_tests else _SKIP_DIRS
    dist = importlib.metadata.distribution(name)
    out = []
    for f in dist.files or []:
        rel = Path(str(f))
        if rel.suffix == ".py" and ".." not in rel.parts and not any(p in skip for p in rel.parts[:-1]):
            out.append((f"site-packages/{name}/{rel.as_posix()}", Path(dist.locate_file(f))))
    return sorted(out)


def _hash(rel: str) -> int:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16)


def extra_package_texts(name: str) -> list[tuple[str, str]]:
    """(relative path, text) of the training files extra package `name` gives: its files (tests included) in
    sha1(path) order, held-out files and tables skipped, whole files while they fit in EXTRA_MAX_BYTES."""
    package_licence(name)
    out, size = [], 0
    for rel, p in sorted(package_files(name, with_tests=True), key=lambda f: _hash(f[0])):
        if is_validation(rel) or not (text := _read(p)) or is_table(text):
            continue
        n = len(text.encode())
        if size + n <= EXTRA_MAX_BYTES:
            out.append((rel, text))
            size += n
    return sorted(out)


def corpus_files() -> list[tuple[str, Path]]:
    """Every candidate file of the core corpus: the standard library's, then each package's in `PACKAGES` order."""
    files = stdlib_files()
    for name in PACKAGES:
        package_licence(name)
        files += package_files(name)
    return files


def is_validation(rel: str) -> bool:
    return _hash(rel) % VAL_BUCKETS == 0


def is_table(text: str) -> bool:
    """A generated table rather than code: at least TABLE_MIN_BYTES, and numbers and strings make up more than
    TABLE_LITERAL_SHARE of its names and literals (Python's tokenizer; a file it cannot read counts as a table)."""
    if len(text) < TABLE_MIN_BYTES:
        return False
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return True
    literals = sum(t.type in (tokenize.NUMBER, tokenize.STRING) for t in tokens)
    names = sum(t.type == tokenize.NAME for t in tokens)
    return literals > TABLE_LITERAL_SHARE * max(1, literals + names)


def _read(p: Path) -> str | None:
    """A file's text with LF line ends and one final newline; None when unreadable as UTF-8 or blank."""
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text.replace("\r\n", "\n").strip("\n") + "\n" if text.strip() else None


def training_documents(which: str = "core") -> list[str]:
    """Training files' texts, held-out files and tables excluded: the core corpus in `corpus_files` order, then for
    ``which="extended"`` each of `EXTRA_PACKAGES` in order (`extra_package_texts`)."""
    if which not in CORPORA:
        raise ValueError(f"corpus: unknown corpus {which!r}; expected one of {CORPORA}")
    docs = []
    for rel, p in corpus_files():
        if not is_validation(rel):
            text = _read(p)
            if text and not is_table(text):
                docs.append(text)
    if which == "extended":
        docs += [text for name in EXTRA_PACKAGES for _, text in extra_package_texts(name)]
    return docs


def manifest(which: str = "core") -> dict:
    """What the corpus is made of: the Python version, and per package its version, licence, whether its tests are
    read, and the files and bytes it gives the training set."""
    def entry(name: str, texts: list[str], tests: bool) -> dict:
        return {"name": name, "version": importlib.metadata.version(name), "licence": package_licence(name),
                "tests": tests, "files": len(texts), "bytes": sum(len(t.encode()) for t in texts)}

    packages = [entry(name, [t for rel, p in package_files(name)
                             if not is_validation(rel) and (t := _read(p)) and not is_table(t)], False)
                for name in PACKAGES]
    packages += [entry(name, [t for _, t in extra_package_texts(name)], True)
                 for name in (EXTRA_PACKAGES if which == "extended" else ())]
    return {"python": sysconfig.get_python_version(), "corpus": which, "packages": packages}


def _whole_files(files, max_bytes: int) -> str:
    """The (relative path, path) `files` in their order, tables and unreadable files skipped, each whole and headed
    by ``# <relative path>``, as long as their texts fit in ``max_bytes`` UTF-8 bytes."""
    parts, size = [], 0
    for rel, p in files:
        text = _read(p)
        if not text or is_table(text):
            continue
        n = len((text + FILE_SEP).encode())
        if size + n > max_bytes:
            continue
        parts.append(f"# {rel}\n{text}")
        size += n
    return FILE_SEP.join(parts)


def build_validation_text(root: Path | None = None, max_bytes: int = VAL_MAX_BYTES) -> str:
    """Held-out standard-library files (tables excluded) concatenated in path order, whole files only, up to
    ``max_bytes`` UTF-8 bytes."""
    return _whole_files([(rel, p) for rel, p in stdlib_files(root) if is_validation(rel)], max_bytes)


def build_test_suite_text(root: Path | None = None, max_bytes: int = TEST_SUITE_MAX_BYTES) -> str:
    """The second held-out set: files of CPython's own test suite (the stdlib's ``test`` folder, which training
    never reads) whose ``sha1(test/<path>) % TEST_SUITE_BUCKETS == 0``, tables excluded, whole files in path order,
    up to ``max_bytes`` UTF-8 bytes of file text; each headed by ``# test/<path>``."""
    folder = (root or stdlib_dir()) / "test"
    picked = []
    for p in sorted(folder.rglob("*.py")):
        rel = "test/" + p.relative_to(folder).as_posix()
        if _hash(rel) % TEST_SUITE_BUCKETS == 0 and "__pycache__" not in rel:
            picked.append((rel, p))
    return _whole_files(picked, max_bytes)


def test_suite_text() -> str:
    """The shipped second held-out text (``deltaserve/data/cpython_tests.txt``)."""
    return TEST_SUITE_PATH.read_text(encoding="utf-8")


def validation_text() -> str:
    """The shipped held-out text (``deltaserve/data/validation.txt``)."""
    return VALIDATION_PATH.read_text(encoding="utf-8")
