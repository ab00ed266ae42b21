"""House rules the code base keeps, checked on its source: no module over `MAX_LINES` lines,
and no two of unbroken's packages importing each other, however indirectly (a package graph
that is a hierarchy: each part can be read, tested and replaced from the bottom up)."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import unbroken

ROOT = Path(unbroken.__file__).parent
MAX_LINES = 600

BEING_SPLIT: frozenset[str] = frozenset()
"""Modules allowed over the limit while being split (none now)."""
"""Modules still allowed over `MAX_LINES`."""


def _modules() -> dict[str, Path]:
    """Every module of unbroken by dotted name (a package by its own name)."""
    return {
        ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted(ROOT.rglob("*.py"))
    }


def _package(module: str) -> str:
    """The part of unbroken a module belongs to: its subpackage (``control``), or for a
    module at the top its own name (``job``)."""
    return module.split(".")[1]


def _runtime_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module makes when it runs, in functions too; not those under
    ``if TYPE_CHECKING:`` (annotations only)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _imported(node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The unbroken modules an import statement loads."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if node.level or not node.module or node.module not in modules:
        return set()
    submodules = {f"{node.module}.{a.name}" for a in node.names}
    return {node.module} | (submodules & modules.keys())


def package_graph() -> dict[str, dict[str, list[str]]]:
    """Package → the packages it imports at run time → the imports that make that edge
    (``module -> module``). The package ``unbroken`` itself (the public API) is left out:
    it sits above everything."""
    modules = _modules()
    graph: dict[str, dict[str, list[str]]] = {}
    for name, path in modules.items():
        if name == "unbroken":
            continue
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, modules):
                if target == "unbroken" or _package(target) == _package(name):
                    continue
                graph.setdefault(_package(name), {}).setdefault(_package(target), []).append(f"{name} -> {target}")
    return graph


def _cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The package cycles, each once: from a package back to itself."""
    found: list[list[str]] = []
    for start in sorted(graph):
        stack = [[start]]
        while stack:
            path = stack.pop()
            for nxt in graph.get(path[-1], {}):
                if nxt == start:
                    found.append([*path, start])
                elif nxt not in path and nxt > start:  # each cycle found from its least package
                    stack.append([*path, nxt])
    return found


def test_no_module_is_longer_than_the_limit() -> None:
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules().values()}
    long = {m: n for m, n in sorted(lengths.items()) if n > MAX_LINES and m not in BEING_SPLIT}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"
    assert lengths.keys() >= BEING_SPLIT, f"not modules any more: {sorted(BEING_SPLIT - lengths.keys())}"


def test_the_package_graph_has_no_cycle() -> None:
    graph = package_graph()
    assert {"control", "train", "comm", "state"} <= graph.keys(), sorted(graph)  # the graph was read
    shown = []
    for cycle in _cycles(graph):
        edges = [f"{a} -> {b}: {', '.join(graph[a][b][:3])}" for a, b in itertools.pairwise(cycle)]
        shown.append(" | ".join(edges))
    assert not shown, "packages that import each other:\n" + "\n".join(shown)


def test_the_cycle_finder_finds_a_cycle_through_three_packages() -> None:
    graph = {"a": {"b": ["a.x -> b.y"]}, "b": {"c": ["b.y -> c.z"]}, "c": {"a": ["c.z -> a.x"]}, "d": {"a": []}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b": []}, "b": {}}) == []


def test_typing_only_imports_are_not_edges_but_function_level_ones_are() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from unbroken.job import Job\n"
        "def f():\n    from unbroken.events import Kind\n"
    )
    names = {n.module for n in _runtime_imports(tree) if isinstance(n, ast.ImportFrom)}
    assert names == {"typing", "unbroken.events"}
