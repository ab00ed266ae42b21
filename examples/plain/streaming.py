"""Streaming data: an IterableDataset, or a directory of shards, read in order.

Plain PyTorch in one process: what ``examples/streaming.py`` ports to unbroken.

    python examples/plain/streaming.py
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset

from unbroken.demo.charlm import VOCAB, corpus

CONTEXT = 8


def encode(line: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The last CONTEXT characters before a line's final one, and that character."""
    ids = [VOCAB.find(c) % len(VOCAB) for c in line[-(CONTEXT + 1) :].rjust(CONTEXT + 1)]
    return torch.tensor(ids[:-1]), torch.tensor(ids[-1])


def lines() -> list[str]:
    """The lines in a fixed shuffled order (a stream must yield the same order every time)."""
    out = [line for line in corpus().splitlines() if len(line) > 2]
    random.Random(0).shuffle(out)
    return out


class Lines(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples as a stream yields them: no length, no indexing."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for line in lines():
            yield encode(line)


def write_shards(directory: Path, shards: int = 4) -> None:
    """The same lines as text shards of about equal size (what a data pipeline leaves)."""
    directory.mkdir(parents=True, exist_ok=True)
    all_lines = lines()
    step = -(-len(all_lines) // shards)
    for i in range(shards):
        (directory / f"part-{i:05d}.txt").write_text("\n".join(all_lines[i * step : (i + 1) * step]) + "\n")


class NextChar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), 16)
        self.head = nn.Sequential(nn.Linear(16 * CONTEXT, 64), nn.Tanh(), nn.Linear(64, len(VOCAB)))
        self.delay_s = float(os.environ.get("UB_TEST_DELAY_MS", "0")) / 1000  # tests: signals land mid-step

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.head(self.embed(ids).flatten(1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="streaming")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = NextChar()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    while step < args.steps:
        for x, y in DataLoader(Lines(), batch_size=32):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == args.steps:
                break


if __name__ == "__main__":
    main()
