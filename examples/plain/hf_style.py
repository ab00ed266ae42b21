"""A Hugging Face-style model: built from a config, called with a dict, returns its loss.

Plain PyTorch in one process: what ``examples/hf_style.py`` ports to unbroken.

    python examples/plain/hf_style.py
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, default_collate

from unbroken.demo.charlm import VOCAB, encoded


@dataclass
class TinyConfig:
    vocab_size: int = len(VOCAB)
    n_positions: int = 32
    n_embd: int = 32
    n_head: int = 2
    n_layer: int = 1


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyCausalLM(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        layer = nn.TransformerEncoderLayer(
            config.n_embd, config.n_head, 4 * config.n_embd, dropout=0.0, batch_first=True, norm_first=True
        )
        self.h = nn.TransformerEncoder(layer, config.n_layer, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.delay_s = float(os.environ.get("UB_TEST_DELAY_MS", "0")) / 1000  # tests: signals land mid-step

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        if self.delay_s:
            time.sleep(self.delay_s)
        t = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(torch.arange(t, device=input_ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)
        logits = self.lm_head(self.ln_f(self.h(x, mask=mask, is_causal=True)))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return CausalLMOutput(loss, logits)


class Windows(Dataset[dict[str, torch.Tensor]]):
    """Samples as a tokenizer's output would be: dicts of ``input_ids`` and ``labels``."""

    def __init__(self, context: int, count: int, offset: int = 0) -> None:
        self.data, self.context, self.count, self.offset = encoded(), context, count, offset

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = (self.offset + i * 7919) % (len(self.data) - self.context - 1)
        chunk = self.data[start : start + self.context + 1]
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


def lm_step(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    out: CausalLMOutput = model(**batch)
    assert out.loss is not None
    return out.loss


@torch.no_grad()
def heldout(model: nn.Module) -> dict[str, float]:
    """Mean loss on 256 windows the training samples do not start at."""
    model.eval()
    windows = Windows(TinyConfig().n_positions, 256, offset=3)
    batch = default_collate([windows[i] for i in range(len(windows))])
    loss = lm_step(model, batch).item()
    model.train()
    return {"heldout_loss": loss}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hf_style")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    config = TinyConfig()
    torch.manual_seed(0)
    model = TinyCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = Windows(config.n_positions, 4096)
    loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    step = 0
    while step < args.steps:
        for batch in loader:
            loss = lm_step(model, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == args.steps:
                break
    print(heldout(model))


if __name__ == "__main__":
    main()
