"""The documentation a newcomer reads stays short, linked and true.

The README is the front page: at most 300 lines, every relative link (and its anchor) pointing
at something that exists. The site's pages name only `unbroken` commands and options that the
CLI has and files the repository holds, and the API reference covers every name of
`unbroken.__all__`. Broken links inside the site itself fail `mkdocs build --strict` (scripts/check).
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

import unbroken
from unbroken.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.M)
# `unbroken SUB ...` in a code span or a code block line, up to the job's own arguments.
COMMAND = re.compile(r"(?<!from )\bunbroken ([a-z]+)\b([^`\n]*)")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def slug(heading: str) -> str:
    """The anchor GitHub and mkdocs' toc both give a plain heading."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"\s+", "-", text)


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8")))}


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def broken_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {shown(dest)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {shown(dest)}")
    return broken


def test_the_readme_stays_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into a page under docs/ "
        "and link to it"
    )


def test_every_relative_link_of_the_readme_resolves() -> None:
    links = LINK.findall(FENCE.sub("", README.read_text(encoding="utf-8")))
    assert any(link.startswith("docs/") for link in links), "the README links into docs/ by relative paths"
    broken = broken_links(README)
    assert broken == [], "\n".join(broken)


def test_the_link_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# Here\n\n## A part\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-part) [gone](missing.md) [no anchor](there.md#elsewhere) [web](https://example.org/x)\n"
        "```\n[in code](ignored.md)\n```\n",
        encoding="utf-8",
    )
    broken = broken_links(page)
    assert len(broken) == 2 and broken[0].startswith("missing.md") and broken[1].startswith("there.md#elsewhere")


def _subcommands() -> dict[str, set[str]]:
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert actions, "unbroken's parser has no subcommands"
    return {name: set(sub._option_string_actions) for name, sub in actions[0].choices.items()}


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _commands(page: Path) -> list[tuple[str, str]]:
    """Each `unbroken SUB ...` written as code: in code spans and in code blocks."""
    text = page.read_text(encoding="utf-8")
    code = [m.group(0) for m in FENCE.finditer(text)]
    code += re.findall(r"`[^`\n]+`", FENCE.sub("", text))
    return [(m.group(1), m.group(2)) for block in code for m in COMMAND.finditer(block)]


def test_the_docs_name_only_commands_and_options_the_cli_has() -> None:
    cli = _subcommands()
    wrong = []
    seen = 0
    for page in _pages():
        for sub, rest in _commands(page):
            seen += 1
            where = page.relative_to(ROOT)
            if sub not in cli:
                wrong.append(f"{where}: `unbroken {sub}` is no subcommand (there are {', '.join(sorted(cli))})")
                continue
            own = rest.split(" -- ")[0].split("#")[0]  # the job's arguments and comments are not ours
            for option in OPTION.findall(own):
                if option not in cli[sub]:
                    wrong.append(f"{where}: `unbroken {sub}` has no option {option}")
    assert seen > 50, f"only {seen} commands found in the docs: is the pattern still right?"
    assert wrong == [], "\n".join(wrong)


def _documented() -> tuple[set[str], set[str]]:
    """Objects (``::: a.b.Name``) and whole modules the API reference renders."""
    objects, modules = set(), set()
    for page in (DOCS / "api").glob("*.md"):
        for target in re.findall(r"^::: ([\w.]+)", page.read_text(encoding="utf-8"), re.M):
            try:
                importlib.import_module(target)
            except ModuleNotFoundError:
                objects.add(target)
            else:
                modules.add(target)
    return objects, modules


@pytest.mark.parametrize("name", unbroken.__all__)
def test_the_api_reference_covers_each_public_name(name: str) -> None:
    objects, modules = _documented()
    value = getattr(unbroken, name)
    home = getattr(value, "__module__", None)
    by_module = home in modules and home != "unbroken" and hasattr(importlib.import_module(home), name)
    by_object = any(target.rsplit(".", 1)[-1] == name and target.startswith(f"{home}.") for target in objects)
    assert by_module or by_object, f"unbroken.{name} (from {home}) is in no `:::` directive under docs/api/"


PATH_IN_REPO = re.compile(r"(?<![\w/.])((?:bench|examples|scripts|tests|src)/[\w./*-]*[\w*])")


def test_every_file_of_the_repository_the_docs_name_exists() -> None:
    missing = [
        f"{page.relative_to(ROOT)}: {path}"
        for page in _pages()
        for path in PATH_IN_REPO.findall(page.read_text(encoding="utf-8"))
        if not any(ROOT.glob(path))
    ]
    assert missing == [], "\n".join(missing)
