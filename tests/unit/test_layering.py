"""The library stands without its test harness and its CLI: importing it loads neither."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import unbroken
for name in ("Node", "join", "Coordinator", "run_node", "StepProtocol", "Job"):
    getattr(unbroken, name)
import unbroken.train.runtime, unbroken.swarm, unbroken.control.coordinator, unbroken.control.relay
print(sorted(m for m in sys.modules if m.startswith(("unbroken.testing", "unbroken.cli", "unbroken.demo"))))
"""


def test_importing_the_library_loads_neither_the_testing_aids_nor_the_cli() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_cli_node_loads_the_fault_plan_but_not_the_cluster_harness() -> None:
    probe = "import sys, unbroken.testing.faults; print(sorted(m for m in sys.modules if m.startswith('unbroken.')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    loaded = out.stdout.strip()
    assert "unbroken.testing.faults" in loaded
    assert "unbroken.testing.cluster" not in loaded and "unbroken.cli" not in loaded, loaded


def _imports() -> dict[str, set[str]]:
    """Each module's imports of other unbroken modules, at run time (not under TYPE_CHECKING)."""
    import ast
    from pathlib import Path

    import unbroken

    root = Path(unbroken.__file__).parent
    names = {
        ".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in root.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)
        }
        out: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("unbroken"):
                out |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module for a in node.names
                }
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name.startswith("unbroken")}
        graph[name] = {m for m in out if m in names and m != name}
    return graph


def test_no_module_imports_itself_through_others() -> None:
    graph = _imports()
    assert graph.get("unbroken.train.runtime")
    cycles = []
    for start in graph:
        seen, stack = set(), [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, cycles[:5]
