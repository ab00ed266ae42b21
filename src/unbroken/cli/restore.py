"""``unbroken restore``: rebuild a checkpoint from erasure-coded fragments.

    unbroken restore --from /mnt/node1/ckpt --from /mnt/node2/ckpt --from /mnt/node4/ckpt --to /shared/ckpt

Reads every fragment and manifest in the ``--from`` directories (the nodes' own disks,
copied or mounted), checks each fragment's checksum, rebuilds the newest step that K good
fragments allow (or ``--step``), and writes it as a plain checkpoint into ``--to``. A
manifest or fragment that is not what it should be is named on stderr and skipped; older
steps are tried. Nodes
started with ``--checkpoint-dir`` pointing there resume from it, however many they are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _restore(args: argparse.Namespace) -> int:
    import torch

    from unbroken.state.checkpoint import checkpoint_path
    from unbroken.state.directio import Temp
    from unbroken.state.fragments import rebuild

    sources = [Path(d) for d in args.source]
    snap, manifest, notes = rebuild(sources, args.step)
    for note in notes:
        print(f"unbroken restore: {note}", file=sys.stderr)
    out = Path(args.to)
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    path = checkpoint_path(out, manifest.step)
    temp = Temp(out, path.name)  # nothing planted in --to can take the bytes elsewhere
    try:
        with open(temp.fd, "wb", closefd=False) as f:
            torch.save(snap, f)
        temp.commit()
    except BaseException:
        temp.discard()
        raise
    print(
        f"restored step {manifest.step} from {manifest.k} of {manifest.k + manifest.m} fragments "
        f"(digest {manifest.digest[:16]}) into {path}"
    )
    return 0


def add_parser(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser("restore", help="rebuild a checkpoint from erasure-coded fragments", formatter_class=fmt)
    p.add_argument("--from", dest="source", action="append", required=True, help="a directory with fragments (repeat)")
    p.add_argument("--to", required=True, help="directory to write the rebuilt checkpoint into")
    p.add_argument("--step", type=int, help="rebuild this step (default: the newest that can be rebuilt)")
    p.set_defaults(func=_restore)
