"""How many lines each example changes against its plain single-process version (module
docstrings and blank lines left out): ``python scripts/example_diffs.py``."""

from __future__ import annotations

import ast
import difflib
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PAIRS = [("plain_loop.py", "own_loop.py")] + [
    (f"plain/{name}.py", f"{name}.py") for name in ("real_training", "hf_style", "gan", "streaming")
]


def code(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    first = ast.parse(text).body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and first.end_lineno:
        lines = lines[first.end_lineno :]
    return [line for line in lines if line.strip()]


def main() -> None:
    print(f"{'example':<28} {'plain version':<34} {'added':>6} {'removed':>8} {'plain lines':>12}")
    for plain, ported in PAIRS:
        before, after = code(EXAMPLES / plain), code(EXAMPLES / ported)
        lines = difflib.unified_diff(before, after, lineterm="", n=0)
        diff = [line for line in lines if line[:3] not in ("+++", "---")]
        added = sum(line.startswith("+") for line in diff)
        removed = sum(line.startswith("-") for line in diff)
        print(f"examples/{ported:<19} examples/{plain:<25} {added:>6} {removed:>8} {len(before):>12}")


if __name__ == "__main__":
    main()
