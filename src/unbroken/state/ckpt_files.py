"""The checkpoint files of a directory: their names, the newest that loads, and corrupt
or foreign ones set aside (`unbroken.state.checkpoint` writes them).

A file named ``ckpt-<step>.pt`` is complete (the writer renames it into place once it is
synced), but it may still be corrupt (a disk's error, another run's file): a node restores
from the newest that loads and holds training state, and says why each newer one did not.
Reading never follows a symbolic link (`directio.open_read`).
"""

from __future__ import annotations

import dataclasses
import errno
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from unbroken.state import directio

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:09d}.pt"


def checkpoint_steps(directory: Path) -> list[tuple[int, Path]]:
    """The checkpoint files of ``directory`` by step, oldest first."""
    return sorted((int(mt.group(1)), p) for p in directory.iterdir() if (mt := _NAME.match(p.name)))


def latest_checkpoint(directory: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    if not directory.is_dir():
        return None
    found = checkpoint_steps(directory)
    return found[-1][1] if found else None


def load_checkpoint(path: Path, map_location: str | None = None) -> dict[str, Any]:
    """The state in ``path`` (not followed where it is a symbolic link: `directio.open_read`)."""
    with directio.open_read(path) as f:
        snap: dict[str, Any] = torch.load(f, map_location=map_location, weights_only=True)
    return snap


def unusable(
    path: Path, map_location: str | None = None, *, step: int | None = None, job: str | None = None
) -> str | None:
    """Why the checkpoint ``path`` cannot be used (it does not load, or holds no training
    state: of ``step`` and of the job whose identity is ``job``, where given), or None; on
    the meta device only its pickle is read (a truncated or garbage file fails there too)."""
    try:
        snap = load_checkpoint(path, map_location)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link: not followed, a checkpoint is read from its directory itself"
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    except Exception as exc:  # torch.load raises whatever the unpickler met
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else 'unreadable'}"
    if not isinstance(snap, dict) or not {"step", "cursor", "model"} <= snap.keys():
        return "ValueError: it holds no training state"
    if step is not None and snap["step"] != step:
        return f"ValueError: it holds the training state of step {snap['step']}, not of step {step}"
    if job is not None and snap.get("job", job) != job:
        return f"another job's (job identity {snap['job']}, not {job})"
    return None


@dataclasses.dataclass(frozen=True)
class Found:
    """What `load_newest` found in a checkpoint directory."""

    path: Path | None = None
    """The newest checkpoint that loads (None: none does)."""
    snap: dict[str, Any] | None = None
    """Its state."""
    bad: tuple[str, ...] = ()
    """Why each newer one could not be used."""
    refused: int = 0
    """How many of those ``usable`` refused (whole, but not usable now); the others are corrupt."""

    @property
    def all_corrupt(self) -> bool:
        """Checkpoints are there, and none loads."""
        return self.path is None and bool(self.bad) and not self.refused


def load_newest(directory: Path, usable: Callable[[int], str | None] | None = None) -> Found:
    """The newest checkpoint in ``directory`` that loads, and why each newer one did not
    (truncated, garbage, not a state, a link; ``usable(step)``: why a step cannot be used,
    if it cannot, as a sharded job's whose shard files of that step are incomplete)."""
    if not directory.is_dir():
        return Found()
    bad: list[str] = []
    refused = 0
    for step, path in reversed(checkpoint_steps(directory)):
        if usable is not None and (why := usable(step)) is not None:
            bad.append(f"{path} cannot be used ({why})")
            refused += 1
            continue
        why = unusable(path)
        if why is None:
            return Found(path, load_checkpoint(path), tuple(bad), refused)
        bad.append(f"{path} cannot be used ({why})")
    return Found(bad=tuple(bad), refused=refused)


def set_aside(directory: Path, why: str, names: list[str] | None = None) -> Path:
    """Move the checkpoints of ``directory`` (or only ``names``) into a new subdirectory
    (another run's, or corrupt ones: kept, but out of the way of this run's, which
    `Checkpointer` prunes by step)."""
    if names is None:
        names = [p.name for _, p in checkpoint_steps(directory)]
    return directio.move_aside(directory, names, why)
