"""`plain_loop.py` ported to unbroken, its own loop kept (``diff examples/plain_loop.py
examples/own_loop.py`` shows every line that changed). On each machine:

    unbroken run examples/own_loop.py --coordinator HOST:29400 -- --steps 200

With ``-- --shard`` each node holds a range of the model and its optimizer state instead of
the whole (`unbroken.Sharding`; the clipping moves into it: no node holds the whole gradient).
"""

from __future__ import annotations

import argparse
import math
import textwrap
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import unbroken

CONTEXT = 32
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of a text that ships with Python (textwrap's source)."""

    def __init__(self) -> None:
        with open(textwrap.__file__, encoding="utf-8") as f:
            text = f.read()
        ids = [VOCAB.index(c) if c in VOCAB else VOCAB.index("?") for c in text]
        self.ids = torch.tensor(ids)

    def __len__(self) -> int:
        return (len(self.ids) - 1) // CONTEXT

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * CONTEXT : (i + 1) * CONTEXT + 1]
        return chunk[:-1], chunk[1:]


class TinyLM(nn.Module):
    def __init__(self, dim: int = 48, layers: int = 2, delay_s: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), dim)
        self.pos = nn.Parameter(torch.randn(CONTEXT, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, len(VOCAB))
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT))
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)  # stands in for a bigger model: a step takes a while
        h = self.embed(x) + self.pos[: x.shape[1]]
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def warmup_cosine(warmup: int, total: int):  # type: ignore[no-untyped-def]
    return lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))


def log(losses: list[float], loss: float) -> None:
    losses.append(loss)
    if len(losses) % 50 == 0:
        print(f"step {len(losses)}: loss {loss:.4f}", flush=True)


def forever(loader: DataLoader, steps: int):  # type: ignore[no-untyped-def,type-arg]
    """The loader's batches, pass after pass, for ``steps`` steps."""
    while True:
        for batch in loader:
            if steps == 0:
                return
            steps -= 1
            yield batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="charlm")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--out", help="save the final model and the losses here")
    parser.add_argument("--shard", action="store_true", help="shard the state over the nodes")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    swarm = unbroken.join(job="charlm", batch_size=32, steps=args.steps)
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(Windows(), batch_size=32, shuffle=True, drop_last=True, generator=generator)
    model = TinyLM(delay_s=args.delay_ms / 1000)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(10, args.steps))
    shard = unbroken.Sharding(clip_norm=1.0) if args.shard else False
    model, opt, sched = swarm.replicate(model, opt, sched, shard=shard)
    clip = None if args.shard else lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    losses: list[float] = []
    for x, y in swarm.batches(loader, before_update=clip):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        swarm.backward(loss)
        if swarm.step():
            log(losses, loss.item())
    if args.out and not args.shard:  # sharded: each node's range is in its --final-state
        torch.save({"model": model.state_dict(), "losses": losses}, args.out)


if __name__ == "__main__":
    main()
