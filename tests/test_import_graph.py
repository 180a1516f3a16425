"""The house's walls: no import cycle between infermux's sub-packages, no private name across them.

The import graph is read from the source with `ast` (nothing is imported). Every import counts,
those inside functions and under `TYPE_CHECKING` too: a lazy import hides a cycle, it does not
remove it. A node is a sub-package (`runtime`, `partition`, ...) or a top-level module
(`agreement`, `errors`, ...); the package's own `__init__` is its public face, not a node.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import networkx as nx

SRC = Path(__file__).resolve().parent.parent / "src" / "infermux"


def _node(module: str) -> str | None:
    """`infermux.runtime.session` → `runtime`; `infermux.errors` → `errors`; the root → None."""
    parts = module.split(".")
    if parts[0] != "infermux" or len(parts) < 2:
        return None
    return parts[1]


def _module_of(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) of every import in a file."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, [a.name for a in node.names], node.lineno))
    return out


def _graph() -> tuple[nx.DiGraph, list[str]]:
    graph: nx.DiGraph = nx.DiGraph()
    private: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        here = _node(_module_of(path))
        if here is None:
            continue
        graph.add_node(here)
        for module, names, line in _imports(path):
            there = _node(module)
            if there is None or there == here:
                continue
            graph.add_edge(here, there, where=f"{path.relative_to(SRC.parent)}:{line}")
            private.extend(f"{path.relative_to(SRC.parent)}:{line} takes {module}.{n}"
                           for n in names if n.startswith("_") and not n.startswith("__"))
    return graph, private


def test_no_cycle_between_sub_packages() -> None:
    graph, _ = _graph()
    assert {"runtime", "partition", "models", "serve", "cluster"} <= set(graph)  # it saw them
    cycles = sorted(nx.simple_cycles(graph), key=len)
    lines = []
    for cycle in cycles[:10]:
        hops = zip(cycle, [*cycle[1:], cycle[0]], strict=True)
        lines.append(" → ".join(f"{a} ({graph.edges[a, b]['where']})" for a, b in hops)
                     + f" → {cycle[0]}")
    assert not cycles, "import cycles between sub-packages:\n" + "\n".join(lines)


def test_no_private_name_imported_across_sub_packages() -> None:
    _, private = _graph()
    assert not private, "private names imported from another sub-package:\n" + "\n".join(private)


def test_edges_are_found() -> None:
    graph, _ = _graph()
    # The fronts code against the runtime; the runtime never reaches back to them.
    assert graph.has_edge("serve", "runtime") and not graph.has_edge("runtime", "serve")
    assert graph.has_edge("partition", "runtime") and not graph.has_edge("runtime", "partition")
    counts: dict[str, int] = defaultdict(int)
    for a, _b in graph.edges:
        counts[a] += 1
    assert counts["cli"] > 3
