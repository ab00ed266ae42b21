"""``unbroken assemble``: the model of a sharded job, from its nodes' final states or its
shard checkpoint files.

    unbroken assemble model.pt n1.final.pt n2.final.pt n3.final.pt
    unbroken assemble model.pt ckpt/shard-000000400-*.pt

Each node of a sharded job (`unbroken.Sharding`) writes the ranges it holds into its
``--final-state`` file, and its primary range into ``shard-STEP-START-END.pt`` at each
checkpoint. This puts ranges that cover the model together into one plain state dict
(``model.load_state_dict(torch.load("model.pt"))``), after checking that they are of one
step of one model and cover every element.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _assemble(args: argparse.Namespace) -> int:
    import torch

    from unbroken.errors import ConfigError
    from unbroken.train.sharding import assemble

    parts = []
    for name in args.final:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"unbroken assemble: {path} is not a file: give the nodes' --final-state files")
        state = torch.load(path, weights_only=True)
        if isinstance(state, dict) and "shard" in state:
            parts.append(state["shard"])
        elif isinstance(state, dict) and {"values", "spans", "start", "end"} <= state.keys():
            parts.append(state)  # a shard checkpoint file (shard-STEP-START-END.pt)
        else:
            raise ConfigError(
                f"{path} is neither a sharded node's --final-state nor a shard checkpoint file (shard-*.pt); "
                "a replicated job's final state is the whole model already: load its 'model'"
            )
    try:
        model = assemble(parts)
    except ValueError as exc:
        raise ConfigError(
            f"{exc}: give the --final-state files of the nodes that finished, or every shard-STEP-*.pt of one step"
        ) from None
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(model, tmp)
    tmp.replace(out)
    numel = sum(v.numel() for v in model.values())
    print(
        f"assembled {len(model)} tensors ({numel:,} elements) of step {parts[0].get('step')} into {out}",
        file=sys.stderr,
    )
    return 0


def add_parser(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser(
        "assemble", help="put a sharded job's finished model together from its nodes' final states", formatter_class=fmt
    )
    p.add_argument("out", help="where to write the model's state dict")
    p.add_argument("final", nargs="+", help="the finished nodes' --final-state files")
    p.set_defaults(func=_assemble)
