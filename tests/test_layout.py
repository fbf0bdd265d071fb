"""The design as the file tree shows it, checked: which code runs inside vLLM's workers and what
it may import, no import circle, no private name used across modules. Static (the source's
syntax trees) except the first test, which imports the worker extension in a fresh interpreter
as vLLM does."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "weightsync"

#: What a vLLM worker may load of weightsync when it imports the worker extension: the lazy
#: package ``__init__``s on the way, the code under ``in_engine/``, the wire both sides speak,
#: and the two stdlib-only modules every side shares.
WORKER_SIDE = {
    "weightsync",
    "weightsync.lazy",
    "weightsync.errors",
    "weightsync.engines",
    "weightsync.engines.vllm",
    "weightsync.engines.vllm.worker",
}
WORKER_SIDE_PACKAGES = ("weightsync.engines.vllm.in_engine", "weightsync.wire")


def _worker_side(module: str) -> bool:
    return module in WORKER_SIDE or any(
        module == p or module.startswith(p + ".") for p in WORKER_SIDE_PACKAGES
    )


def test_the_worker_extension_imports_no_trainer_side_module():
    code = (
        "import json, sys\n"
        "from weightsync.engines.vllm.worker import WeightsyncWorker\n"
        "mine = sorted(m for m in sys.modules if m.startswith('weightsync'))\n"
        "print(json.dumps([mine, 'vllm' in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    loaded, imported_vllm = json.loads(out.splitlines()[-1])
    print("\n".join(loaded))  # the list, for the record (pytest -s)
    outside = [m for m in loaded if not _worker_side(m)]
    assert outside == [], f"the worker extension imports trainer-side modules: {outside}"
    assert "weightsync.engines.vllm.in_engine.extension" in loaded
    assert not imported_vllm  # vLLM imports itself in its workers; weightsync does not


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(name: str, tree: ast.Module, known: set[str]) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import outside ``if TYPE_CHECKING``,
    relative ones resolved; a name that is a submodule counts as importing it."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.append((base, [a.name for a in node.names]))
            found += [(f"{base}.{a.name}", []) for a in node.names if f"{base}.{a.name}" in known]
    return found


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def test_no_import_circle():
    modules = _modules()
    graph = {
        name: {m for m, _ in _imports(name, tree, set(modules)) if m in modules and m != name}
        for name, tree in modules.items()
    }
    circles = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == [], f"import circles: {circles}"


@pytest.mark.parametrize("kind", ["from-import", "attribute"])
def test_no_private_name_across_modules(kind):
    modules = _modules()
    crossing = []
    for name, tree in modules.items():
        imports = _imports(name, tree, set(modules))
        if kind == "from-import":
            crossing += [
                f"{name}: from {m} import {n}"
                for m, names in imports
                if m.startswith("weightsync")
                for n in names
                if n.startswith("_") and not n.startswith("__")
            ]
            continue
        aliases = {n.rsplit(".", 1)[-1] for m, _ in imports if m in modules for n in [m]}
        crossing += [
            f"{name}: {node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ]
    assert crossing == [], f"private names used across modules: {crossing}"
