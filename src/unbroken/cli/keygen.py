"""``unbroken keygen FILE``: a node's (or relay's) identity key (`unbroken.control.identity`),
and the line of it a coordinator's ``--allowed-keys`` file takes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from unbroken.control import identity


def _keygen(args: argparse.Namespace) -> int:
    path = Path(args.file)
    key = identity.load_or_create(path, private=False) if args.show and path.exists() else identity.create(path)
    public = identity.public_text(key)
    print(f"{public}  {args.name or path.stem}")
    print(
        f"# {'read' if args.show else 'wrote'} {path} (id {identity.key_id(public)}); add the line above to the "
        f"coordinator's --allowed-keys file and start the node with --key {path}",
        file=sys.stderr,
    )
    return 0


def add_parser(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    k = sub.add_parser(
        "keygen",
        help="make a node's (or relay's) identity key; prints the line a coordinator's --allowed-keys takes",
        formatter_class=fmt,
    )
    k.add_argument("file", help="where to write the private key (mode 0600; never over an existing file)")
    k.add_argument("--name", help="the name written after the public key (default: the file's stem)")
    k.add_argument("--show", action="store_true", help="print the public line of the key already in FILE")
    k.set_defaults(func=_keygen)
