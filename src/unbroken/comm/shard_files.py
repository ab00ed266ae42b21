"""Checkpoints of a sharded zone: each member writes its own range, and a restore re-shards
to any number of members.

A member writes only its primary range (values and optimizer state) to
``shard-<step>-<start>-<end>.pt``; the buddy copies are the same bytes, written by their
primaries. A restore looks for the newest step whose files cover the whole flat space
and reads, for each range the new layout gives a member, the parts of the files that
overlap it: ``n`` writers, ``m`` readers, any ``n`` and ``m``. Files are written under a
temporary name and renamed, so a reader never sees half of one. Gathering the files of a
job whose members wrote on their own disks into one directory is the caller's part (as
`unbroken restore` gathers checkpoint fragments).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from unbroken.comm.sharded import ShardedModel
from unbroken.errors import TransferError
from unbroken.state.directio import Temp
from unbroken.state.shards import Layout

_NAME = re.compile(r"shard-(\d{9})-(\d{12})-(\d{12})\.pt")


def save_shard(zone: ShardedModel, directory: Path, step: int) -> Path | None:
    """Write this member's primary range at ``step``; None for a member without one (a spare)."""
    shard = zone.layout.primary(zone.me)
    if shard is None:
        return None
    part = zone.export(shard.start, shard.end)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"shard-{step:09d}-{shard.start:012d}-{shard.end:012d}.pt"
    payload: dict[str, Any] = {"step": step, "numel": zone.layout.numel, "start": shard.start, "end": shard.end}
    # What `unbroken assemble` needs to make a model of the files of one step.
    payload |= {"spans": zone.spans(), "buffers": {n: b.detach().clone() for n, b in zone.model.named_buffers()}}
    # Resolved here (the operator may name the directory through a link); no link planted
    # in the directory redirects the write.
    temp = Temp(directory.resolve(), path.name)
    try:
        with open(temp.fd, "wb", closefd=False) as f:
            torch.save(payload | {"values": part["values"], "state": part["state"]}, f)
        temp.commit()
    except BaseException:
        temp.discard()
        raise
    return path


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


def prune_shards(directory: Path, numel: int, keep: int) -> None:
    """Delete the shard files of steps older than the ``keep`` newest complete ones."""
    steps = complete_steps(directory, numel)
    if len(steps) <= keep:
        return
    oldest = steps[keep - 1]
    for f in directory.glob("shard-*.pt"):
        if (m := _NAME.fullmatch(f.name)) is not None and int(m[1]) < oldest:
            f.unlink(missing_ok=True)


def restore_shards(zone: ShardedModel, directory: Path, layout: Layout, me: str, step: int | None = None) -> int:
    """Load what ``layout`` gives ``me`` from the newest complete step in ``directory`` (or
    from ``step``); returns that step.

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
        data: dict[str, Any] = torch.load(f, weights_only=True)
        if (data["step"], data["start"], data["end"], data["numel"]) != (step, start, end, layout.numel):
            raise TransferError(
                f"{f} holds step {data['step']} [{data['start']}, {data['end']}), not what its name says"
            )
        state = data["state"]
        flat = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        counts |= {k: torch.as_tensor(v) for k, v in state.items() if k not in flat}
        pieces.append((start, end, {"values": data["values"], **flat}))
    stepped = any(len(bufs) > 1 for _, _, bufs in pieces)  # moments saved: the optimizer had stepped
    zone.load(layout, me, pieces, counts if stepped else None)
    return step
