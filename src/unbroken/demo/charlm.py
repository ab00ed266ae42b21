"""A small character-level language model on text that ships with Python.

The corpus is the documentation strings of a few dozen standard-library modules (about
200 KB of English and code examples), so the demo needs no download. The vocabulary is
fixed (printable ASCII and newline), so every node builds the same model whatever its
Python version; the job identity includes the dataset size, so nodes whose corpora differ
are refused rather than mixed.

Run it on its own with::

    unbroken coordinator --port 29400 &
    unbroken node --coordinator 127.0.0.1:29400 unbroken.demo.charlm:job
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
from functools import cache

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from unbroken.job import Job

MODULES = (
    "argparse", "collections", "json", "textwrap", "string", "random", "heapq", "functools",
    "pathlib", "typing", "email.message", "http.client", "logging", "shutil", "subprocess",
    "unittest.case", "inspect", "dataclasses", "asyncio.tasks", "decimal", "fractions",
    "statistics", "calendar", "difflib", "csv", "zipfile", "tarfile", "threading", "queue", "socket",
)  # fmt: skip
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
UNKNOWN = VOCAB.index("?")
CONTEXT = 32


@cache
def corpus() -> str:
    docs = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for obj in [mod] + [getattr(mod, a) for a in sorted(vars(mod)) if not a.startswith("_")]:
            if obj is mod or getattr(obj, "__module__", None) == mod.__name__:
                doc = inspect.getdoc(obj)
                if doc:
                    docs.append(doc)
    return "\n\n".join(docs)


@cache
def encoded() -> torch.Tensor:
    table = {c: i for i, c in enumerate(VOCAB)}
    return torch.tensor([table.get(c, UNKNOWN) for c in corpus()], dtype=torch.long)


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i: the CONTEXT characters starting at i, and the character after them."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids) - CONTEXT

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i : i + CONTEXT], self.ids[i + CONTEXT]


class CharMLP(nn.Module):
    """Embedding of a fixed window, two dense layers; deterministic (no dropout)."""

    def __init__(self, vocab: int = len(VOCAB), dim: int = 24, hidden: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(CONTEXT * dim, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(1)
        out: torch.Tensor = self.out(torch.tanh(self.hidden(h)))
        return out


def split() -> tuple[CharWindows, CharWindows]:
    ids = encoded()
    cut = int(len(ids) * 0.9)
    return CharWindows(ids[:cut]), CharWindows(ids[cut:])


def evaluate(model: nn.Module, max_samples: int = 4096) -> dict[str, float]:
    """Held-out loss in bits per character (lower is better; uniform guessing is 6.6)."""
    _, held_out = split()
    n = min(len(held_out), max_samples)
    step = max(1, len(held_out) // n)
    xs, ys = zip(*(held_out[i] for i in range(0, step * n, step)), strict=True)
    loss = F.cross_entropy(model(torch.stack(xs)), torch.stack(ys)).item()
    return {"heldout_bits_per_char": loss / math.log(2)}


def sample_text(model: nn.Module, prompt: str = "Return the ", length: int = 120) -> str:
    """Greedy continuation of ``prompt``, to see what the model learned."""
    table = {c: i for i, c in enumerate(VOCAB)}
    ids = [table.get(c, UNKNOWN) for c in prompt.rjust(CONTEXT)]
    with torch.no_grad():
        for _ in range(length):
            logits = model(torch.tensor([ids[-CONTEXT:]]))
            ids.append(int(logits.argmax(-1)))
    return prompt + "".join(VOCAB[i] for i in ids[CONTEXT:])


def make_job(num_steps: int = 900, batch_size: int = 192, lr: float = 3e-3, seed: int = 0) -> Job:
    train, _ = split()
    return Job(
        name="charlm",
        model=CharMLP,
        optimizer=lambda model: torch.optim.Adam(model.parameters(), lr=lr),
        dataset=train,
        loss=F.cross_entropy,
        batch_size=batch_size,
        num_steps=num_steps,
        seed=seed,
        evaluate=evaluate,
    )


def job() -> Job:
    """The demo job; ``UNBROKEN_DEMO_STEPS`` shortens or lengthens it."""
    steps = os.environ.get("UNBROKEN_DEMO_STEPS")
    return make_job(num_steps=int(steps)) if steps else make_job()
