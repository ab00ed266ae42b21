"""A run's directory: its nodes' commit logs and its coordinator's event log, as streams.

``unbroken demo --out DIR``, ``unbroken chaos --out DIR`` and `unbroken.testing.LocalCluster`
write one: ``NAME.jsonl`` per node (``unbroken node --commit-log DIR/NAME.jsonl``) and
``events.jsonl`` (``unbroken coordinator --event-log DIR/events.jsonl``). A file is told
apart by its first line (an event has a ``seq``; a node's entry has a ``kind`` of
`unbroken.events.Entry`), not by its name, so a real job's logs gathered into one directory
work as they are. Lines are read as they come, never a whole file at once; a line that is
not JSON (cut short when its node was killed) is left out, and said.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.errors import ConfigError
from unbroken.events import Entry, Recorded
from unbroken.observe.judge import judge
from unbroken.observe.verdict import Expect, Verdict

EXPECTED = (
    "the nodes' commit logs (NAME.jsonl, one per node, written by `unbroken node --commit-log DIR/NAME.jsonl`) "
    "and the coordinator's event log (`unbroken coordinator --event-log DIR/events.jsonl`)"
)


class CommitLog:
    """One node's commit log: each call is a fresh pass over its entries."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.line = 0
        """The line the pass in progress is at."""
        self.unreadable: list[int] = []
        """Lines that are not JSON (found by the first pass)."""
        self._passes = 0

    def __call__(self) -> Iterator[dict[str, Any]]:
        self._passes += 1
        first = self._passes == 1
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for self.line, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    yield json.loads(text)
                except json.JSONDecodeError:
                    if first:
                        self.unreadable.append(self.line)

    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class RunDir:
    path: Path
    logs: dict[str, CommitLog]
    """Node (the file's name without .jsonl) → its commit log."""
    event_logs: list[Path]
    others: list[Path] = field(default_factory=list)
    """``.jsonl`` files that are neither."""

    def notes(self) -> list[str]:
        out = [f"{p.name}: neither a commit log nor an event log, left out" for p in self.others]
        for log in self.logs.values():
            lines = log.unreadable
            if len(lines) == 1 and lines[0] == log.line:
                out.append(f"{log.path.name}: its last line is cut short (the node was killed writing it), left out")
            elif lines:
                shown = ", ".join(map(str, lines[:5])) + (", ..." if len(lines) > 5 else "")
                out.append(f"{log.path.name}: {len(lines)} lines are not JSON, left out (lines {shown})")
        return out


def _what(path: Path) -> str | None:
    """ "events", "commits" (an empty file too: a node that logged nothing) or None, by its first JSON line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, text in enumerate(f):
            if n >= 20:
                break
            try:
                d = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(d, dict) and {"seq", "time", "kind"} <= d.keys():
                return "events"
            if isinstance(d, dict) and d.get("kind") in set(Entry):
                return "commits"
            return None
    return "commits" if path.stat().st_size == 0 else None


def find(path: Path, event_logs: Sequence[Path] = ()) -> RunDir:
    """The logs in ``path`` (and the event logs given besides).

    Raises:
        ConfigError: ``path`` is no directory, holds no commit log, or an event log given is missing.
    """
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory: give the run's directory, which holds {EXPECTED}")
    run = RunDir(path, {}, [])
    for p in sorted(path.glob("*.jsonl")):
        what = _what(p)
        if what == "events":
            run.event_logs.append(p)
        elif what == "commits":
            run.logs[p.stem] = CommitLog(p)
        else:
            run.others.append(p)
    for p in event_logs:
        if not p.is_file():
            raise ConfigError(f"--event-log {p}: no such file")
        if p.resolve() not in {q.resolve() for q in run.event_logs}:
            run.event_logs.append(p)
    if not run.logs:
        found = f"; its .jsonl files are not: {', '.join(p.name for p in run.others + run.event_logs)}"
        raise ConfigError(
            f"{path} holds no commit log: expected {EXPECTED}{found if run.others or run.event_logs else ''}"
        )
    return run


def read_events(paths: Sequence[Path]) -> Iterator[Recorded]:
    """The events of each event log in turn, as they are read.

    Raises:
        ConfigError: a line is JSON but no event this version writes (names the file and the line).
    """
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, text in enumerate(f, 1):
                try:
                    d = json.loads(text)
                except json.JSONDecodeError:
                    continue  # cut short by a crash
                try:
                    yield Recorded.from_json(d)
                except (KeyError, ValueError, TypeError, AttributeError) as exc:
                    raise ConfigError(
                        f"{path}:{n}: not an event of an event log ({type(exc).__name__}: {exc})"
                    ) from None


def verify(path: Path, expect: Expect, event_logs: Sequence[Path] = ()) -> tuple[Verdict, RunDir]:
    """The verdict on the run in ``path``.

    Raises:
        ConfigError: the directory or a line of a log cannot be read as one (says which).
    """
    run = find(path, event_logs)
    events = read_events(run.event_logs) if run.event_logs else None
    verdict = judge(dict(run.logs), expect, events)
    verdict.notes[:0] = run.notes()
    return verdict, run
