"""Streaming data: an IterableDataset, or a directory of shards, read in order.

Neither has a length to permute; the step's position in the stream is the committed step, so
a retried step and a joiner read exactly the samples one process would have read at that
step. The samples: lines of text that ships with Python, each turned into (the previous
characters, the next one) for a small next-character model.

    unbroken node --coordinator 127.0.0.1:29400 examples/streaming.py:make -- --steps 300
    unbroken node --coordinator 127.0.0.1:29400 examples/streaming.py:make -- --shards /data/shards
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
from torch.utils.data import IterableDataset

from unbroken import Job
from unbroken.demo.charlm import VOCAB, corpus
from unbroken.train.stream import IterableStream, ShardStream

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


def make(argv: list[str]) -> Job:
    parser = argparse.ArgumentParser(prog="streaming")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--shards", help="a directory of text shards (default: an IterableDataset)")
    args = parser.parse_args(argv)
    source = ShardStream(args.shards, "*.txt", decode=lambda line: encode(line.rstrip("\n"))) if args.shards else None
    return Job(
        name="streaming",
        model=NextChar,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        dataset=source or IterableStream(Lines, name="stdlib-doc-lines"),
        loss=F.cross_entropy,
        batch_size=32,
        num_steps=args.steps,
        seed=0,
    )
