"""Passes over the nodes' commit logs, for `unbroken.observe.judge`.

A log is a function that starts a fresh pass over its entries (`Logs`): a file read line
by line (`unbroken.observe.rundir.CommitLog`) or a list in memory. `first_pass` checks every
entry and finds what a node took with it when it died; `merged` gives every node's entries
in wall-time order; `slices` gives the samples of a few (epoch, step)s; `fingerprint` sums a
multiset of sample indices into 64 bits, so that a step's samples are compared without
keeping them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from unbroken.errors import ConfigError
from unbroken.events import Entry

MASK = (1 << 64) - 1
_SALT = 0x5EED

Logs = Mapping[str, Callable[[], Iterable[dict[str, Any]]]]
"""Node → a fresh pass over its commit log's entries, in the order written."""


@dataclass
class First:
    """What the first pass over one node's log found."""

    gone: list[tuple[int, int]] = field(default_factory=list)
    """Runs of steps (0-based, inclusive) the node committed and then died or was expelled
    with before it logged anything of a later epoch: its state never reached another member.
    Not a node that left: a graceful leave hands its state on (`unbroken.train.leaving`), and
    a group training its steps again after it lost them."""
    final_step: int | None = None
    """The step of its last ``final`` entry (None: it never finished)."""

    def took(self, s: int) -> bool:
        return any(lo <= s <= hi for lo, hi in self.gone)


_NEEDS: dict[Entry, tuple[str, ...]] = {
    Entry.CONTRIB: ("epoch", "step", "indices"),
    Entry.COMMIT: ("epoch", "step"),
    Entry.SYNC: ("step", "digest"),
    Entry.RESTORE: ("step", "digest"),
    Entry.FINAL: ("step", "digest"),
    Entry.AUDIT: ("step", "digest"),
}


def first_pass(node: str, read: Callable[[], Iterable[dict[str, Any]]]) -> First:
    """Check each entry of ``node``'s log; find the steps it took with it (`First.gone`).

    Raises:
        ConfigError: an entry no node writes: where (``read.where()``, a file and line, if
            it says), and what is wrong with it.
    """
    out = First()
    pending: list[list[int]] = []  # [epoch, lo, hi]: runs of steps committed in an epoch
    located = getattr(read, "where", None)
    for n, e in enumerate(read(), 1):
        if (problem := malformed(e)) is not None:
            raise ConfigError(f"{located() if callable(located) else f'{node}: entry {n}'}: {problem}")
        kind, epoch = Entry(e["kind"]), e.get("epoch")
        if kind is Entry.EXPELLED:
            out.gone += [(lo, hi) for _, lo, hi in pending]
            pending = []
        elif kind is Entry.LEFT:
            pending = []
        elif epoch is not None:
            pending = [p for p in pending if p[0] >= epoch]
            if kind is Entry.COMMIT:
                s = e["step"] - 1
                if pending and pending[-1][0] == epoch and pending[-1][2] == s - 1:
                    pending[-1][2] = s
                else:
                    pending.append([epoch, s, s])
        if kind is Entry.FINAL:
            out.final_step = max(e["step"], out.final_step or 0)
    out.gone += [(lo, hi) for _, lo, hi in pending]
    return out


def malformed(e: Any) -> str | None:
    """What makes ``e`` no entry a node writes (None: nothing)."""
    if not isinstance(e, dict):
        return f"{type(e).__name__} where an entry (a JSON object) belongs"
    try:
        kind = Entry(e.get("kind"))
    except ValueError:
        return f"{e.get('kind')!r} is no kind of commit-log entry ({', '.join(k.value for k in Entry)})"
    missing = [f for f in _NEEDS.get(kind, ()) if e.get(f) is None]
    if missing:
        return f"a {kind.value} entry with no {', '.join(missing)}"
    if not _number(e.get("t", 0.0)):
        return f"a {kind.value} entry whose time t is {e.get('t')!r}"
    for name in ("epoch", "step"):
        if e.get(name) is not None and not (isinstance(e[name], int) and not isinstance(e[name], bool)):
            return f"a {kind.value} entry whose {name} is {e[name]!r}, not a whole number"
    if e.get("digest") is not None and not isinstance(e["digest"], str):
        return f"a {kind.value} entry whose digest is {e['digest']!r}"
    if kind is Entry.CONTRIB and not (isinstance(e["indices"], list) and set(map(type, e["indices"])) <= {int}):
        return "a contrib entry whose indices are not a list of sample indices"
    return None


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def merged(logs: Logs) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every node's entries by wall time (ties: in the order of ``logs``, then as written).
    A node's log is in its own order; a time that goes back (its clock was set back) counts
    as the time before it."""

    def timed(node: str, entries: Iterable[dict[str, Any]]) -> Iterator[tuple[float, str, dict[str, Any]]]:
        last = float("-inf")
        for e in entries:
            last = max(last, float(e.get("t", 0.0)))
            yield last, node, e

    for _, node, e in heapq.merge(*(timed(n, read()) for n, read in logs.items()), key=lambda x: x[0]):
        yield node, e


def slices(logs: Logs, keys: set[tuple[int, int]]) -> dict[tuple[int, int], list[tuple[str, list[int]]]]:
    """(epoch, step) → each slice logged for it: (node, sample indices)."""
    out: dict[tuple[int, int], list[tuple[str, list[int]]]] = defaultdict(list)
    for node, read in logs.items():
        for e in read():
            if e.get("kind") == Entry.CONTRIB and (key := (int(e["epoch"]), int(e["step"]))) in keys:
                out[key].append((node, list(e["indices"])))
    return out


def fingerprint(indices: list[int]) -> tuple[int, int]:
    """How many indices, and the sum of their hashes: equal for equal multisets, whatever the
    order (and for unequal ones once in 2**64). Python hashes a tuple of ints the same in
    every process, and in C: ten times faster than a hash written in Python."""
    return len(indices), sum(map(hash, zip(indices, itertools.repeat(_SALT)))) & MASK


def short(digest: str) -> str:
    return digest[:16]


def ranges(steps: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s in steps:
        if out and out[-1][1] == s - 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out
