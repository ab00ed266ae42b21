"""The node's helpers depend on what they read and write of it (`unbroken.train.views`),
not on `Node`: none imports the runtime or names `Node`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import unbroken.train

HELPERS = ["audits", "checks", "compute", "diloco", "epochs", "records", "step"]
TRAIN = Path(unbroken.train.__file__).parent


@pytest.mark.parametrize("name", HELPERS)
def test_a_helper_neither_imports_the_runtime_nor_takes_the_whole_node(name: str) -> None:
    tree = ast.parse((TRAIN / f"{name}.py").read_text())
    imports = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "unbroken.train.runtime" not in imports, f"train/{name}.py imports the runtime"
    annotations = [ast.unparse(n.annotation) for n in ast.walk(tree) if isinstance(n, ast.arg) and n.annotation]
    assert "Node" not in annotations, f"train/{name}.py takes the whole Node: give it its view"
