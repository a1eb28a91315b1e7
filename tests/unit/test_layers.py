"""The package's layers and the absence of import cycles, as contracts.

Read from the source (every ``import`` and ``from ... import``, those inside
functions too), so a lazy import cannot hide a cycle. A module imports only from its
own layer or the ones below it; ``supervisor.core``'s purity (no I/O at all) is
checked by what it loads, in tests/unit/core/test_purity.py.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Lowest first. The package root holds only __version__; atomic_write is a leaf.
LAYERS = (
    ("supervisor", "supervisor.atomic_write", "supervisor.core"),
    ("supervisor.flashinfer",),
    ("supervisor.fleet",),
    ("supervisor.adapters",),
    ("supervisor.daemon",),
    ("supervisor.commands",),
    ("supervisor.cli", "supervisor.__main__"),
)


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in (ROOT / "supervisor").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "__pycache__" in parts or "venv_scripts" in parts:
            continue  # run inside the serving venv, never imported
        found[".".join(parts).removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield full if full in known else node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def layer_of(module: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != "supervisor" and module.startswith(prefix + ".")):
                return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: {t for t in imports(path, known) if t in known and t != name}
        for name, path in known.items()
    }


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = [
        f"{source} -> {target}"
        for source, targets in graph().items()
        for target in targets
        if layer_of(target) > layer_of(source)
    ]
    assert upward == []


def test_there_is_no_import_cycle() -> None:
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert cycles == []


def test_the_contract_sees_what_it_checks() -> None:
    """Not vacuous: the graph has the edges it must have, and a layer's own name."""
    edges = graph()
    assert "supervisor.fleet.bundle" in edges["supervisor.fleet.distribute"]
    assert "supervisor.core.machine" in edges["supervisor.core.policy"]
    assert layer_of("supervisor.fleet.archive") > layer_of("supervisor.flashinfer.cache")
