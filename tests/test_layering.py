"""The package's layering, checked on the source: `ops -> layers -> models`, the caches beside the models on the
`ModelCache` interface, the execution `backends` over the models (beside them the drafters and the prefill/decode
transfer over the caches), `engine` over them, `server` on top. A module imports only from its own package or from a
package of a lower rank, and no chain of imports between modules comes back to where it started (imports inside
functions count too: a local import that hides a cycle is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "deltaserve"

# Rank of each top-level package or module of deltaserve: an import must go to a strictly lower rank (or stay
# inside its own package). `__init__` (the public facade) and `cli` sit on top of everything.
RANKS = {
    "errors": 0, "envs": 0, "version": 0,
    "config": 1, "json_flag": 1, "tokenizer": 1, "vision": 1, "default_model": 1,
    "ops": 2, "distributed": 2,
    "layers": 3, "chat": 3,
    "models": 4, "cache": 4,
    "backends": 5, "spec_decode": 5, "disagg": 5,
    "engine": 6,
    "server": 7,
    "tools": 8,
    "cli": 9, "__init__": 9, "__main__": 9,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the deltaserve modules (or packages) `path` imports, anywhere in the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "deltaserve" or target.startswith("deltaserve."):
                for alias in node.names:  # `from . import native` names a module
                    candidate = f"{target}.{alias.name}"
                    found.add(candidate if _exists(candidate) else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("deltaserve.")}
    return found


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def test_every_package_has_a_rank():
    tops = {_top(m) for m in _graph()}
    assert tops <= set(RANKS), f"packages without a rank: {sorted(tops - set(RANKS))}"


def test_no_upward_import():
    bad = []
    for module, targets in _graph().items():
        src = _top(module)
        for target in targets:
            dst = _top(target)
            if dst != src and RANKS[dst] >= RANKS[src]:
                bad.append(f"{module} imports {target} ({src} rank {RANKS[src]} -> {dst} rank {RANKS[dst]})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycle():
    graph = _graph()
    edges = {m: {t for t in ts if t in graph} for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in edges[node]:
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue  # a package and its own modules
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_the_checks_see_imports():
    """The walker finds relative, absolute and function-local imports (else the checks above would pass vacuously)."""
    graph = _graph()
    assert "deltaserve.layers.batch" in graph["deltaserve.cache.paged_cache"]
    assert "deltaserve.models.mtp" in graph["deltaserve.models.base"]
    assert "deltaserve.engine.core" in graph["deltaserve.server.messages"]
    assert any(t.startswith("deltaserve.ops.") for t in graph["deltaserve.layers.mla"])


def test_the_model_is_math_only():
    """layers/ and models/ never reach the native kernels or keep a switch for how they run: the backends decide
    that (docs/architecture.md §4)."""
    graph = _graph()
    bad = [f"{m} imports {t}" for m, ts in graph.items() if _top(m) in ("layers", "models")
           for t in ts if t == "deltaserve.ops.native" or _top(t) == "backends"]
    switches = ("self.native", "self.prepack", "fuse_blocks", "fuse_stack", "native_library")
    for path in [*(PACKAGE / "layers").glob("*.py"), *(PACKAGE / "models").glob("*.py")]:
        bad += [f"{path.name} names {s}" for s in switches if s in path.read_text()]
    assert not bad, "\n".join(bad)
