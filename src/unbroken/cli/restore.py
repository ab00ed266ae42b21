"""``unbroken restore``: put a checkpoint together from the nodes' own disks.

    unbroken restore --from /mnt/node1/ckpt --from /mnt/node2/ckpt --from /mnt/node4/ckpt --to /shared/ckpt

Reads every fragment and manifest in the ``--from`` directories (the nodes' own disks,
copied or mounted), checks each fragment's checksum, rebuilds the newest step that K good
fragments allow (or ``--step``), and writes it as a plain checkpoint into ``--to``. A
sharded job's checkpoint is also its members' shard files (``shard-STEP-START-END.pt``):
the step restored is then the newest that both the fragments (or a plain checkpoint) and
good shard files of every range give, one copy of each range checked against its digest
and copied into ``--to``. A manifest, fragment or shard file that is not what it should be
is named on stderr and skipped; older steps are tried. Nodes started with
``--checkpoint-dir`` pointing there resume from it, however many they are.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

_SHARD = re.compile(r"shard-(\d{9})-\d{12}-\d{12}\.pt")
_CHECKPOINT = re.compile(r"ckpt-(\d{9})\.pt")


def _restore(args: argparse.Namespace) -> int:
    from unbroken.comm.shard_files import gather
    from unbroken.errors import TransferError

    sources = [Path(d) for d in args.source]
    out = Path(args.to)
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    sharded = sorted({int(m[1]) for d in sources if d.is_dir() for f in d.iterdir() if (m := _SHARD.fullmatch(f.name))})
    if not sharded:
        _replicated(sources, out, args.step)
        return 0
    notes: list[str] = []
    for step in reversed(sharded):
        if args.step is not None and step != args.step:
            continue
        # Gathered aside, and moved in only once the same step's replicated state is there: a
        # step's ranges alone in --to would be taken for a checkpoint's by a later restore.
        aside = out / f".gathering-{os.getpid()}"
        try:
            _, files, why = gather(sources, aside, step)
            notes += why
            _replicated(sources, out, step)
        except TransferError as exc:
            notes.append(f"step {step}: {exc}")
            shutil.rmtree(aside, ignore_errors=True)
            continue
        for f in files:
            os.replace(f, out / f.name)
        shutil.rmtree(aside, ignore_errors=True)
        _say(notes)
        print(f"gathered {len(files)} shard files of step {step} into {out}")
        return 0
    _say(notes)
    which = f"step {args.step}" if args.step is not None else "any step"
    print(
        f"unbroken restore: no good checkpoint of {which} with shard files covering the state: see above",
        file=sys.stderr,
    )
    return 1


def _replicated(sources: list[Path], out: Path, step: int | None) -> None:
    """The replicated state of ``step`` (or the newest) into ``out``: rebuilt from
    fragments, else a plain checkpoint found in a source, copied.

    Raises:
        NotRebuilt: neither is there."""
    import torch

    from unbroken.state.checkpoint import checkpoint_path
    from unbroken.state.directio import copy_file, write_whole
    from unbroken.state.fragments import NotRebuilt, rebuild

    try:
        snap, manifest, notes = rebuild(sources, step)
    except NotRebuilt:
        plain = sorted(
            (int(m[1]), f) for d in sources if d.is_dir() for f in d.iterdir() if (m := _CHECKPOINT.fullmatch(f.name))
        )
        plain = [(s, f) for s, f in plain if step is None or s == step]
        if not plain:
            raise
        found, path = plain[-1]
        copy_file(path, out)
        print(f"copied the checkpoint of step {found} from {path} into {checkpoint_path(out, found)}")
        return
    _say(notes)
    path = checkpoint_path(out, manifest.step)
    write_whole(out, path.name, lambda f: torch.save(snap, f))  # nothing planted in --to takes the bytes
    print(
        f"restored step {manifest.step} from {manifest.k} of {manifest.k + manifest.m} fragments "
        f"(digest {manifest.digest[:16]}) into {path}"
    )


def _say(notes: list[str]) -> None:
    for note in notes:
        print(f"unbroken restore: {note}", file=sys.stderr)


def add_parser(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser(
        "restore",
        help="put a checkpoint together from the nodes' own disks (fragments, a sharded job's shard files)",
        formatter_class=fmt,
    )
    p.add_argument(
        "--from", dest="source", action="append", required=True, help="a node's checkpoint directory (repeat)"
    )
    p.add_argument("--to", required=True, help="directory to write the restored checkpoint into")
    p.add_argument("--step", type=int, help="restore this step (default: the newest that can be)")
    p.set_defaults(func=_restore)
