"""Asynchronous, atomic checkpoints in a directory.

The step loop only copies the state (a `TrainState.capture`); serialising and writing run
on a background thread into ``ckpt-<step>.pt.tmp``, fsynced, then renamed, so a file named
``ckpt-<step>.pt`` is always complete. If the previous write is still running, the new
checkpoint is skipped rather than blocking the step.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch

from unbroken.state.snapshot import snapshot_digest

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
KEEP = 3


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:09d}.pt"


def latest_checkpoint(directory: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    if not directory.is_dir():
        return None
    found = sorted((int(mt.group(1)), p) for p in directory.iterdir() if (mt := _NAME.match(p.name)))
    return found[-1][1] if found else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    snap: dict[str, Any] = torch.load(path, weights_only=True)
    return snap


class Checkpointer:
    """Writes captured states in the background, one at a time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._thread: threading.Thread | None = None
        self.written: list[tuple[int, float]] = []
        self.skipped = 0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save_async(self, snap: dict[str, Any]) -> bool:
        """Start writing ``snap``; returns False (and skips) if a write is still running."""
        if self.busy:
            self.skipped += 1
            return False
        self._thread = threading.Thread(target=self._write, args=(snap,), name="checkpoint-writer", daemon=True)
        self._thread.start()
        return True

    def save_fragments_async(
        self, snap: dict[str, Any], k: int, m: int, mine: list[int], optimizer_in_digest: bool = True
    ) -> bool:
        """Start writing this node's erasure-coded fragments of ``snap`` (`unbroken.state.fragments`)."""
        if self.busy:
            self.skipped += 1
            return False
        self._thread = threading.Thread(
            target=self._write_fragments,
            args=(snap, k, m, mine, optimizer_in_digest),
            name="fragment-writer",
            daemon=True,
        )
        self._thread.start()
        return True

    def _write_fragments(self, snap: dict[str, Any], k: int, m: int, mine: list[int], in_digest: bool) -> None:
        from unbroken.state.fragments import write_fragments

        start = time.monotonic()
        try:
            write_fragments(self.directory, snap, k, m, mine, snapshot_digest(snap, in_digest))
            self.written.append((int(snap["step"]), time.monotonic() - start))
        except OSError:
            log.exception("fragments of step %d failed", snap["step"])

    def _write(self, snap: dict[str, Any]) -> None:
        step = int(snap["step"])
        final = checkpoint_path(self.directory, step)
        tmp = final.with_name(final.name + f".{os.getpid()}.tmp")
        start = time.monotonic()
        try:
            with open(tmp, "wb") as f:
                torch.save(snap, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            self.written.append((step, time.monotonic() - start))
            self._prune()
        except OSError:
            log.exception("checkpoint of step %d failed", step)
            tmp.unlink(missing_ok=True)

    def _prune(self) -> None:
        found = sorted((int(mt.group(1)), p) for p in self.directory.iterdir() if (mt := _NAME.match(p.name)))
        for _, p in found[:-KEEP]:
            p.unlink(missing_ok=True)

    def close(self, timeout: float = 60.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
