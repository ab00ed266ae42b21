"""Checkpoints of a sharded zone: each member writes its own range, and a restore re-shards
to any number of members.

A member writes its primary range (values and optimizer state) to
``shard-<step>-<start>-<end>.pt``, with the digest of what it holds; with ``copies`` (a job
that erasure-codes its checkpoints against lost disks, ``--fragments``) it also writes the
ranges it is buddy for, so that every range lies on two members' disks and the loss of any
one disk loses none (its other copy is the same bytes: the holders agree at every commit).
A restore looks for the newest step whose files cover the whole flat space and reads, for
each range the new layout gives a member, the parts of the files that overlap it: ``n``
writers, ``m`` readers, any ``n`` and ``m``. Files are written under a temporary name and
renamed, so a reader never sees half of one; a file whose bytes do not match its digest
or its name is refused. `gather` picks a good copy of every range of one step from the
members' own disks into one directory (``unbroken restore`` runs it).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from unbroken.comm.reshard import digest_of
from unbroken.comm.sharded import ShardedModel
from unbroken.errors import TransferError
from unbroken.state.directio import copy_file, write_whole
from unbroken.state.shards import Layout

_NAME = re.compile(r"shard-(\d{9})-(\d{12})-(\d{12})\.pt")
_REPLICATED = re.compile(r"(?:ckpt-(\d{9})\.pt|frag-(\d{9})\.json)")


def save_shard(
    zone: ShardedModel,
    directory: Path,
    step: int,
    *,
    copies: bool = False,
    momentum: Callable[[int, int], torch.Tensor | None] | None = None,
) -> list[Path]:
    """Write this member's primary range at ``step`` (``copies``: and the ranges it is buddy
    for); the paths written (none for a spare). ``momentum(start, end)``: the outer
    optimizer's momentum of the range (sharded DiLoCo), written with it (None: it has none)."""
    ranges = [s for s in zone.layout.shards if s.primary == zone.me or (copies and s.buddy == zone.me)]
    if ranges:
        directory.mkdir(parents=True, exist_ok=True)
    # What `unbroken assemble` needs to make a model of the files of one step.
    common: dict[str, Any] = {"step": step, "numel": zone.layout.numel, "spans": zone.spans()}
    common["buffers"] = {n: b.detach().cpu().clone() for n, b in zone.model.named_buffers()}
    written = []
    for shard in ranges:
        part = zone.export(shard.start, shard.end)
        path = directory / f"shard-{step:09d}-{shard.start:012d}-{shard.end:012d}.pt"
        payload = common | {"start": shard.start, "end": shard.end, "values": part["values"], "state": part["state"]}
        moment = momentum(shard.start, shard.end) if momentum is not None else None
        if moment is not None:
            payload["momentum"] = moment
        payload["digest"] = digest_of(part["values"], _checked(part["state"], moment))
        # Resolved here (the operator may name the directory through a link); no link planted
        # in the directory redirects the write. A range's two holders writing into one shared
        # directory write the same bytes: the second rename replaces the first whole.
        write_whole(directory.resolve(), path.name, functools.partial(_save, payload))
        written.append(path)
    return written


def _checked(state: dict[str, Any], momentum: torch.Tensor | None) -> dict[str, Any]:
    """What a file's digest covers besides its values: the optimizer state, and the outer
    momentum where the file has one."""
    return state if momentum is None else state | {"outer-momentum": momentum}


def _save(payload: dict[str, Any], f: BinaryIO) -> None:
    torch.save(payload, f)


def read_shard(path: Path) -> dict[str, Any]:
    """A shard file's contents, checked against its name and its digest.

    Raises:
        TransferError: unreadable, not a shard file, of another step or range than its name
            says, or bytes that are not the ones written (bit rot, a truncated copy).
    """
    m = _NAME.fullmatch(path.name)
    if m is None:
        raise TransferError(f"{path} is not named as a shard file (shard-STEP-START-END.pt)")
    try:
        data: dict[str, Any] = torch.load(path, weights_only=True)
        said = (int(data["step"]), int(data["start"]), int(data["end"]), int(data["numel"]))
        # Files written before digests were have none: read as they were then, unchecked.
        checked = _checked(data["state"], data.get("momentum"))
        spoiled = "digest" in data and digest_of(data["values"], checked) != data["digest"]
    except Exception as exc:  # torch.load raises what the bytes lead it to: all mean "not a good file"
        raise TransferError(f"{path} cannot be read as a shard file ({type(exc).__name__}: {exc})") from exc
    if said[:3] != (int(m[1]), int(m[2]), int(m[3])) or not 0 <= said[1] < said[2] <= said[3]:
        raise TransferError(f"{path} holds step {said[0]} [{said[1]}, {said[2]}), not what its name says")
    if spoiled:
        raise TransferError(f"{path}: its values and optimizer state do not match the digest written with them")
    return data


def complete_steps(directory: Path, numel: int) -> list[int]:
    """The steps whose shard files in ``directory`` cover ``[0, numel)``, newest first."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    for f in directory.glob("shard-*.pt"):
        if (m := _NAME.fullmatch(f.name)) is not None:
            ranges.setdefault(int(m[1]), []).append((int(m[2]), int(m[3])))
    out = []
    for step, spans in ranges.items():
        at = 0
        for start, end in sorted(spans):
            if start > at:
                break
            at = max(at, end)
        if at >= numel:
            out.append(step)
    return sorted(out, reverse=True)


def prune_shards(directory: Path, numel: int, keep: int, own: Sequence[tuple[int, Sequence[Path]]] = ()) -> None:
    """Delete the shard files of steps older than the ``keep`` newest complete ones, and of
    ``own`` (the steps this member wrote, and their files) those older than its ``keep``
    newest: a member's own disk holds its ranges alone, so no step of it is ever complete
    there. Never the files of a step whose replicated checkpoint is in the directory (a
    checkpoint or fragment manifest: its writing may lag, or be skipped, behind the ranges')."""
    kept = _replicated_steps(directory)
    steps = complete_steps(directory, numel)
    if len(steps) > keep:
        oldest = steps[keep - 1]
        for f in directory.glob("shard-*.pt"):
            if (m := _NAME.fullmatch(f.name)) is not None and int(m[1]) < oldest and int(m[1]) not in kept:
                f.unlink(missing_ok=True)
    mine = sorted({at for at, _ in own}, reverse=True)
    if len(mine) > keep:
        for at, paths in own:
            if at < mine[keep - 1] and at not in kept:
                for path in paths:
                    path.unlink(missing_ok=True)


def _replicated_steps(directory: Path) -> set[int]:
    """The steps of the replicated checkpoints (whole, or fragment manifests) in ``directory``."""
    out = set()
    for f in directory.iterdir():
        if (m := _REPLICATED.fullmatch(f.name)) is not None:
            out.add(int(m[1] or m[2]))
    return out


def restore_shards(
    zone: ShardedModel,
    directory: Path,
    layout: Layout,
    me: str,
    step: int | None = None,
    momentum: dict[tuple[int, int], torch.Tensor] | None = None,
) -> int:
    """Load what ``layout`` gives ``me`` from the newest complete step in ``directory`` (or
    from ``step``); returns that step. ``momentum`` gets the outer momentum of each file read
    that has one, by the file's range.

    Raises:
        TransferError: no step's files cover the whole state (``step``'s, where given), or a
            file does not say what its name does.
    """
    steps = complete_steps(directory, layout.numel)
    if step is not None:
        steps = [s for s in steps if s == step]
    if not steps:
        which = "no step's" if step is None else f"step {step}'s"
        raise TransferError(
            f"{which} shard files in {directory} do not cover all {layout.numel:,} elements: gather every "
            "member's shard-*.pt of one step into it"
        )
    step = steps[0]
    wanted = [(s.start, s.end) for s in layout.shards if me in (s.primary, s.buddy)]
    pieces: list[tuple[int, int, dict[str, torch.Tensor]]] = []
    counts: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob(f"shard-{step:09d}-*.pt")):
        m = _NAME.fullmatch(f.name)
        if m is None:
            continue
        start, end = int(m[2]), int(m[3])
        if not any(max(a, start) < min(b, end) for a, b in wanted):
            continue
        data = read_shard(f)
        if int(data["numel"]) != layout.numel:
            raise TransferError(f"{f} is of a {int(data['numel']):,}-element model, not of {layout.numel:,}")
        state = data["state"]
        flat = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        counts |= {k: torch.as_tensor(v) for k, v in state.items() if k not in flat}
        pieces.append((start, end, {"values": data["values"], **flat}))
        if momentum is not None and "momentum" in data:
            momentum[(start, end)] = data["momentum"]
    stepped = any(len(bufs) > 1 for _, _, bufs in pieces)  # moments saved: the optimizer had stepped
    zone.load(layout, me, pieces, counts if stepped else None)
    return step


def gather(directories: Iterable[Path], into: Path, step: int | None = None) -> tuple[int, list[Path], list[str]]:
    """Copy one good copy of every range of the newest step (or ``step``) whose shard files in
    ``directories`` cover the whole state into ``into``, as ranges that do not overlap (a
    step written under two layouts has two cuts); that step, the files written, and what was
    wrong on the way (a copy that failed its check or could not be copied, a step left
    uncovered). Each copy is checked again where it was written.

    Raises:
        TransferError: no step is covered by good files (``step``'s, where given).
    """
    found: dict[int, dict[tuple[int, int], list[Path]]] = {}
    for d in directories:
        for f in sorted(d.glob("shard-*.pt")) if d.is_dir() else ():
            if (m := _NAME.fullmatch(f.name)) is not None:
                found.setdefault(int(m[1]), {}).setdefault((int(m[2]), int(m[3])), []).append(f)
    notes: list[str] = []
    for at in sorted(found, reverse=True):
        if step is not None and at != step:
            continue
        good: dict[tuple[int, int], list[Path]] = {}
        sizes = set()
        for span, copies in sorted(found[at].items()):
            for f in copies:
                try:
                    sizes.add(int(read_shard(f)["numel"]))
                except TransferError as exc:
                    notes.append(f"{exc}: another copy is tried")
                    continue
                good.setdefault(span, []).append(f)
        if len(sizes) != 1:
            what = (
                "no shard file of it can be read"
                if not sizes
                else f"its files are of models of {sorted(sizes)} elements"
            )
            notes.append(f"step {at}: {what}")
            continue
        numel = sizes.pop()
        written = _copy_tiling(good, numel, into, notes)
        if written is None:
            gaps = ", ".join(f"[{a:,}, {b:,})" for a, b in _gaps(set(good), numel)) or "ranges that meet end to end"
            notes.append(f"step {at}: no good copy of {gaps}")
            continue
        return at, written, notes
    which = "no step" if step is None else f"step {step}"
    raise TransferError(
        f"{which} has good shard files covering the whole state in the directories given: " + "; ".join(notes)
    )


def _copy_tiling(
    good: dict[tuple[int, int], list[Path]], numel: int, into: Path, notes: list[str]
) -> list[Path] | None:
    """Copy into ``into`` ranges of ``good`` that cover ``[0, numel)`` end to end, each from
    the first of its copies that copies and checks well; None where no such cover is left
    (what was written for it is removed)."""
    spans = set(good)
    while True:
        cut = _cover(spans, numel)
        if cut is None:
            return None
        written: list[Path] = []
        copied: list[Path] = []
        for span in cut:
            done = None
            for f in good[span]:
                try:
                    into.mkdir(parents=True, exist_ok=True)
                    done = copy_file(f, into)
                    read_shard(done)
                    break
                except (OSError, TransferError) as exc:
                    notes.append(f"{f} could not be copied into {into} ({exc}): another copy is tried")
                    done = None
            if done is None:  # no copy of this range copies: cover the state without it
                spans.discard(span)
                for path in copied:
                    path.unlink(missing_ok=True)
                break
            written.append(done)
            if done.resolve() != f.resolve():  # not a source already in place: removable
                copied.append(done)
        else:
            return written


def _cover(spans: set[tuple[int, int]], numel: int) -> list[tuple[int, int]] | None:
    """Ranges of ``spans`` that tile ``[0, numel)`` end to end (fewest pieces), or None."""
    ways: dict[int, list[tuple[int, int]]] = {0: []}
    frontier = [0]
    while frontier:
        nxt = []
        for at in frontier:
            for span in sorted(spans):
                if span[0] == at and span[1] not in ways:
                    ways[span[1]] = [*ways[at], span]
                    nxt.append(span[1])
        frontier = nxt
    return ways.get(numel)


def _gaps(spans: set[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The parts of ``[0, numel)`` no range of ``spans`` covers."""
    out, at = [], 0
    for start, end in sorted(spans):
        if start > at:
            out.append((at, start))
        at = max(at, end)
    if at < numel:
        out.append((at, numel))
    return out
